"""Loss variants against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from mars2.training.losses import LossConfig, k3_kl, policy_loss

LP = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
OLD = torch.tensor([[-1.2, -1.5, 0.0], [-0.5, -1.0, -0.5]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def _clipped_terms(eps_low: float, eps_high: float) -> list[list[float]]:
    terms = []
    for row in range(2):
        row_terms = []
        for t in range(3):
            r = math.exp(float(LP[row, t] - OLD[row, t]))
            a = float(ADV[row])
            row_terms.append(-min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a))
        terms.append(row_terms)
    return terms


def test_grpo_is_sequence_mean_then_batch_mean() -> None:
    t = _clipped_terms(0.2, 0.2)
    expected = ((t[0][0] + t[0][1]) / 2 + (t[1][0] + t[1][1] + t[1][2]) / 3) / 2
    loss, metrics = policy_loss(LP, OLD, ADV, MASK, LossConfig(variant="grpo"))
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert 0 < float(metrics["clip_fraction"]) < 1


def test_dapo_is_token_mean_with_clip_higher() -> None:
    t = _clipped_terms(0.2, 0.28)
    expected = (t[0][0] + t[0][1] + t[1][0] + t[1][1] + t[1][2]) / 5
    loss, _ = policy_loss(
        LP, OLD, ADV, MASK, LossConfig(variant="dapo", eps_low=0.2, eps_high=0.28)
    )
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_dr_grpo_divides_by_constant_length() -> None:
    t = _clipped_terms(0.2, 0.2)
    expected = (t[0][0] + t[0][1] + t[1][0] + t[1][1] + t[1][2]) / (2 * 10)
    loss, _ = policy_loss(LP, OLD, ADV, MASK, LossConfig(variant="dr_grpo", max_tokens=10))
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_gspo_uses_one_ratio_per_sequence() -> None:
    eps = 0.1
    expected = 0.0
    for row, n in ((0, 2), (1, 3)):
        s = math.exp(float(((LP[row] - OLD[row]) * MASK[row]).sum()) / n)
        a = float(ADV[row])
        expected += -min(s * a, min(max(s, 1 - eps), 1 + eps) * a)
    loss, _ = policy_loss(LP, OLD, ADV, MASK, LossConfig(variant="gspo", eps_low=eps, eps_high=eps))
    assert float(loss) == pytest.approx(expected / 2, rel=1e-6)


def test_k3_kl_and_beta_term() -> None:
    ref = torch.tensor([[-1.1, -1.9, 0.0], [-0.7, -0.2, -0.5]])
    kl = k3_kl(LP, ref)
    d = float(ref[0, 0] - LP[0, 0])
    assert float(kl[0, 0]) == pytest.approx(math.exp(d) - d - 1, rel=1e-4)
    assert torch.all(kl >= 0)
    base, _ = policy_loss(LP, OLD, ADV, MASK, LossConfig())
    with_kl, metrics = policy_loss(LP, OLD, ADV, MASK, LossConfig(beta=0.5), ref_logprobs=ref)
    kl_seq = ((kl[0, :2].sum() / 2) + (kl[1].sum() / 3)) / 2
    assert float(with_kl - base) == pytest.approx(0.5 * float(kl_seq), rel=1e-4)
    assert float(metrics["kl"]) == pytest.approx(float((kl * MASK).sum() / 5), rel=1e-5)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(LP, OLD, ADV, MASK, LossConfig(beta=0.5))


def test_truncated_importance_sampling_caps_the_weight() -> None:
    rollout = OLD - 5.0  # the sampler was far less likely: weight exp(5) capped at 2
    capped, _ = policy_loss(
        LP, OLD, ADV, MASK, LossConfig(variant="dapo", tis_cap=2.0), rollout_logprobs=rollout
    )
    plain, _ = policy_loss(LP, OLD, ADV, MASK, LossConfig(variant="dapo"))
    assert float(capped) == pytest.approx(2 * float(plain), rel=1e-6)


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient() -> None:
    logits = torch.zeros(1, 2, requires_grad=True)
    lp = torch.log_softmax(logits, -1)[:, :1]
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([3.0]), torch.ones(1, 1), LossConfig())
    loss.backward()
    # d/dlogits of -A·log p0 with p = (0.5, 0.5): -A·(1 - p0, -p1) = (-1.5, 1.5)
    assert logits.grad is not None
    assert logits.grad[0].tolist() == pytest.approx([-1.5, 1.5])


def test_bad_variant_is_rejected() -> None:
    with pytest.raises(ValueError, match="variant"):
        LossConfig(variant="ppo")  # type: ignore[arg-type]
