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


def test_k3_kl_masked_outlier_cannot_turn_the_loss_nan() -> None:
    # A masked (padding) position where the reference is 100 nats above the policy: exp(100) = inf
    # in fp32, and inf * 0 = NaN if the mask is applied after exp (the bug this guards).
    ref = LP.clone()
    ref[0, 2] = LP[0, 2] + 100.0  # MASK[0, 2] == 0
    lp = LP.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, OLD, ADV, MASK, LossConfig(beta=0.5), ref_logprobs=ref)
    assert torch.isfinite(loss) and torch.isfinite(metrics["kl"])
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    assert float(metrics["kl"]) == pytest.approx(0.0, abs=1e-7)  # ref == lp on every real token
    assert float(k3_kl(LP, ref, MASK)[0, 2]) == 0.0


def test_k3_kl_clamps_the_log_ratio_to_its_documented_bound() -> None:
    from mars2.training.losses import K3_LOG_RATIO_BOUND

    lp = torch.zeros(1, 2)
    ref = torch.tensor([[100.0, -100.0]])  # real tokens, far outside the bound on both sides
    kl = k3_kl(lp, ref, torch.ones(1, 2))
    b = K3_LOG_RATIO_BOUND
    assert torch.isfinite(kl).all()
    assert float(kl[0, 0]) == pytest.approx(math.exp(b) - b - 1, rel=1e-5)
    assert float(kl[0, 1]) == pytest.approx(math.exp(-b) + b - 1, rel=1e-5)


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


# -- gradients against the papers' formulas -----------------------------------------------------
#
# The references below are the analytic gradients of each paper's objective with respect to the
# token log-probs, written out token by token in float64 (no autograd, no code shared with
# losses.py). A token (or, for GSPO, a sequence) whose min(·) picks the clipped branch gets no
# gradient; otherwise d/dlp of r·A is r·A.

EPS_LOW, EPS_HIGH, MAX_TOKENS = 0.2, 0.28, 7


# Per-row log-ratio offsets (advantages +1.3, -0.7, +0.9, -1.6, +0.4, -0.2): row 0 lands in
# (1.2, 1.28] where only clip-higher lets it through, rows 1 and 2 are clipped, rows 3 and 4 are
# outside the band on the side where the unclipped term is the min, row 5 stays inside.
OFFSETS = [0.215, -0.4, 0.5, 0.3, -0.5, 0.0]


def _case(noise: float, off: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 7, 4, 3, 6]
    rows, width = len(lengths), max(lengths)
    mask = torch.zeros(rows, width, dtype=torch.float64)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1.0
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3 - 0.1
    lp = old + (torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2 - 1) * noise
    if off:
        lp = lp + torch.tensor(OFFSETS, dtype=torch.float64).unsqueeze(-1)
    adv = torch.tensor([1.3, -0.7, 0.9, -1.6, 0.4, -0.2], dtype=torch.float64)
    ref = old + (torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2 - 1) * 0.3
    rollout = old + (torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2 - 1) * 1.5
    return {"lp": lp, "old": old, "adv": adv, "mask": mask, "ref": ref, "rollout": rollout}


def _active(ratio: float, adv: float, eps_low: float, eps_high: float) -> bool:
    return not ((adv > 0 and ratio > 1 + eps_high) or (adv < 0 and ratio < 1 - eps_low))


def _reference_grad(
    c: dict[str, torch.Tensor],
    variant: str,
    eps_low: float = EPS_LOW,
    eps_high: float = EPS_HIGH,
    beta: float = 0.0,
    tis_cap: float | None = None,
) -> torch.Tensor:
    lp, old, adv, mask = c["lp"], c["old"], c["adv"], c["mask"]
    rows, width = lp.shape
    lengths = [int(mask[i].sum()) for i in range(rows)]
    total_tokens = sum(lengths)
    grad = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        a = float(adv[i])
        n = lengths[i]
        seq_ratio = math.exp(sum(float(lp[i, t] - old[i, t]) for t in range(n)) / n)
        for t in range(n):
            if variant == "gspo":  # GSPO eq.: s_i·A_i·(1/|y_i|)·∇log π(y_t), zero when clipped
                r = seq_ratio
                g = -a * r / n * _active(r, a, eps_low, eps_high)
            else:
                r = math.exp(float(lp[i, t] - old[i, t]))
                g = -a * r * _active(r, a, eps_low, eps_high)
            if tis_cap is not None:
                g *= min(math.exp(float(old[i, t] - c["rollout"][i, t])), tis_cap)
            if beta:  # k3 = e^{ref-lp} - (ref-lp) - 1, d/dlp = 1 - e^{ref-lp}
                kl = beta * (1.0 - math.exp(float(c["ref"][i, t] - lp[i, t])))
                g += kl / n if variant == "gspo" else kl
            if variant == "grpo":
                g /= n * rows
            elif variant == "gspo":
                g /= rows
            elif variant == "dapo":
                g /= total_tokens
            else:  # dr_grpo
                g /= rows * MAX_TOKENS
            grad[i, t] = g
    return grad


def _loss_grad(c: dict[str, torch.Tensor], config: LossConfig, **kwargs: float) -> torch.Tensor:
    lp = c["lp"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        lp,
        c["old"],
        c["adv"],
        c["mask"],
        config,
        ref_logprobs=c["ref"] if config.beta else None,
        rollout_logprobs=c["rollout"] if config.tis_cap is not None else None,
        **kwargs,
    )
    loss.backward()
    assert lp.grad is not None
    return lp.grad


VARIANTS = ["grpo", "dr_grpo", "dapo", "gspo"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("off", [False, True], ids=["ratio1", "ratio_off"])
def test_gradient_matches_the_paper_formula(variant: str, off: bool) -> None:
    c = _case(0.03 if off else 0.0, off)
    config = LossConfig(
        variant=variant,  # type: ignore[arg-type]
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        tis_cap=None,
        max_tokens=MAX_TOKENS,
    )
    expected = _reference_grad(c, variant)
    torch.testing.assert_close(_loss_grad(c, config), expected, rtol=1e-9, atol=1e-12)
    if off:  # the case really clips some tokens (or sequences) and leaves others active
        assert (expected[c["mask"] > 0] == 0).any() and (expected[c["mask"] > 0] != 0).any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_with_kl_and_tis_matches_the_formula(variant: str) -> None:
    c = _case(0.03, True, seed=1)
    config = LossConfig(
        variant=variant,  # type: ignore[arg-type]
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        beta=0.05,
        tis_cap=2.0,
        max_tokens=MAX_TOKENS,
    )
    expected = _reference_grad(c, variant, beta=0.05, tis_cap=2.0)
    torch.testing.assert_close(_loss_grad(c, config), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_split_batch_gradients_sum_to_the_whole_batch_gradient(variant: str) -> None:
    """With the step's sizes passed in, per-row losses add up to the whole-batch loss."""
    c = _case(0.3, True, seed=2)
    config = LossConfig(variant=variant, tis_cap=None, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    whole = _loss_grad(c, config)
    rows = c["mask"].shape[0]
    sizes = {"num_sequences": float(rows), "num_tokens": float(c["mask"].sum())}
    parts = [
        _loss_grad({k: v[i : i + 1] for k, v in c.items()}, config, **sizes) for i in range(rows)
    ]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("variant", ["grpo", "dapo", "gspo"])
def test_clip_higher_acts_only_when_ratios_leave_the_band(variant: str) -> None:
    low, high = (
        LossConfig(variant=variant, eps_high=0.2, tis_cap=None),
        LossConfig(  # type: ignore[arg-type]
            variant=variant,  # type: ignore[arg-type]
            eps_high=0.28,
            tis_cap=None,
        ),
    )
    inside = _case(0.15, False, seed=3)  # |log ratio| <= 0.15: every ratio in [0.86, 1.17]
    torch.testing.assert_close(_loss_grad(inside, low), _loss_grad(inside, high))
    outside = _case(0.03, True, seed=3)  # row 0's ratios land in (1.2, 1.28]
    assert not torch.allclose(_loss_grad(outside, low), _loss_grad(outside, high))
    torch.testing.assert_close(
        _loss_grad(outside, high), _reference_grad(outside, variant, 0.2, 0.28)
    )


def test_clip_fraction_counts_the_tokens_whose_gradient_the_clip_removes() -> None:
    """TRL and verl: a ratio above 1+ε_high clips only a positive advantage, one below 1−ε_low only a
    negative one; the other way round min() keeps the unclipped term and its gradient."""
    old = torch.zeros(4, 1)
    logprobs = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]]))  # ratios 1.5, 1.5, 0.5, 0.5
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    for variant in ("grpo", "dapo", "gspo"):
        config = LossConfig(variant=variant, eps_low=0.2, eps_high=0.28, tis_cap=None)  # type: ignore[arg-type]
        live = logprobs.clone().requires_grad_(True)
        loss, metrics = policy_loss(live, old, advantages, mask, config)
        loss.backward()
        assert live.grad is not None
        no_gradient = (live.grad.abs() < 1e-12).float().mean()
        assert float(metrics["clip_fraction"]) == pytest.approx(0.5)  # rows 0 and 3
        assert float(metrics["clip_fraction"]) == pytest.approx(float(no_gradient))
        assert float(metrics["ratio_outside_band"]) == pytest.approx(1.0)  # the old number
