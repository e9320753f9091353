"""Chunked log-probs and entropy against the unchunked computation they replace.

The reference here is what `AgentModule.compute_loss` did before chunking: the model's whole
logits, `token_logprobs` / `token_entropy` on them, then `policy_loss`. The chunked path must give
the same loss, metrics, stored old-policy / reference log-probs and parameter gradients (max abs
difference <= 1e-5 in fp32), for every loss variant, with a temperature other than 1, and must
never hold a [tokens, vocab] tensor larger than one chunk.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mars2.generation.config import GenerationConfig
from mars2.models.hidden import output_head
from mars2.models.loading import LoraSpec, ModelSpec
from mars2.training.agent_module import AgentModule, OptimConfig
from mars2.training.logprobs import chunked_logprobs_and_entropy
from mars2.training.losses import LossConfig, policy_loss, token_entropy, token_logprobs

TOL = 1e-5
CHUNK = 5  # several chunks and a remainder on the batches below
TEMPERATURE = 0.7


def _batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two padded sequences (prompt 4 tokens, completions of 9 and 6 tokens), vLLM log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 13), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 10:] = 0
    completion = torch.zeros(2, 12)
    completion[0, 3:] = 1
    completion[1, 3:9] = 1
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "advantages": torch.tensor([0.8, -1.3]),
        "truncated": torch.tensor([False, True]),
        "rollout_logprobs": -torch.rand(2, 12, generator=g) * 3,
        "has_rollout_logprobs": torch.tensor([True, False]),
    }


def _agent(tiny: Path, loss: LossConfig, lora: bool = False) -> AgentModule:
    torch.manual_seed(0)
    spec = ModelSpec(str(tiny / "tiny_qwen3"), lora=LoraSpec(r=4) if lora else None)
    agent = AgentModule(
        "a", spec, GenerationConfig(backend="vllm", temperature=TEMPERATURE), OptimConfig(), loss
    )
    if lora:  # a non-zero adapter, so that the policy differs from its reference (the base)
        with torch.no_grad():
            for name, p in agent.policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.05)
    return agent


def _unchunked_loss(agent: AgentModule, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """`compute_loss` as it was before chunking: whole logits, then token_logprobs."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    mask = agent.loss_mask(batch)
    logits = agent.policy(input_ids=ids, attention_mask=attention).logits[:, :-1]
    logprobs = token_logprobs(logits, ids[:, 1:], TEMPERATURE)
    old = batch.get("old_logprobs", logprobs.detach())
    rollout = torch.where(
        batch["has_rollout_logprobs"].unsqueeze(-1), batch["rollout_logprobs"], old
    )
    ref = None
    if agent.loss_config.beta > 0:
        with torch.no_grad():
            if agent.model_spec.lora is not None:
                with agent.policy.disable_adapter():
                    ref_logits = agent.policy(input_ids=ids, attention_mask=attention).logits
            else:
                ref_logits = agent._reference[0](input_ids=ids, attention_mask=attention).logits
        ref = token_logprobs(ref_logits[:, :-1], ids[:, 1:], TEMPERATURE)
    loss, metrics = policy_loss(
        logprobs, old, batch["advantages"], mask, agent.loss_config,
        ref_logprobs=ref, rollout_logprobs=rollout,
    )  # fmt: skip
    entropy = token_entropy(logits.detach(), TEMPERATURE)
    metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
    return loss, metrics


def _grads(agent: AgentModule) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in agent.policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("variant", "beta", "lora", "frozen"),
    [
        ("grpo", 0.05, False, False),
        ("dr_grpo", 0.0, False, True),
        ("dapo", 0.05, True, True),
        ("gspo", 1e-3, False, True),
    ],
)
def test_chunked_loss_and_gradient_equal_the_unchunked_ones(
    tiny_models_dir: Path, variant: str, beta: float, lora: bool, frozen: bool
) -> None:
    eps = 3e-4 if variant == "gspo" else 0.2
    loss_config = LossConfig(variant=variant, beta=beta, eps_low=eps, eps_high=eps * 1.3,  # type: ignore[arg-type]
                             mask_truncated=variant == "dr_grpo", max_tokens=12,
                             logprob_chunk_tokens=CHUNK)  # fmt: skip
    agent = _agent(tiny_models_dir, loss_config, lora)
    vocab = agent.policy.config.vocab_size
    batch = _batch(vocab, seed=len(variant))
    if frozen:  # a later update: old and reference log-probs stored by the old-policy pass
        chunked_batch = dict(batch)
        agent.freeze_rollout(chunked_batch)
        with torch.no_grad():
            whole = agent.policy(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits[:, :-1]
        old = token_logprobs(whole, batch["input_ids"][:, 1:], TEMPERATURE)
        torch.testing.assert_close(chunked_batch["old_logprobs"], old, atol=TOL, rtol=0)
        batch = dict(batch, old_logprobs=old + 0.05 * torch.randn_like(old))  # ratio off 1
        chunked_batch["old_logprobs"] = batch["old_logprobs"]
    else:
        chunked_batch = batch
    expected_loss, expected_metrics = _unchunked_loss(agent, batch)
    expected_loss.backward()
    expected_grads = _grads(agent)
    agent.policy.zero_grad(set_to_none=True)

    loss, metrics = agent.compute_loss(chunked_batch)
    loss.backward()
    grads = _grads(agent)
    assert abs(float(loss.detach()) - float(expected_loss.detach())) <= TOL
    for key in ("entropy", "clip_fraction", "ratio", *(["kl"] if beta else [])):
        assert abs(float(metrics[key]) - float(expected_metrics[key])) <= TOL, key
    assert grads.keys() == expected_grads.keys() and grads
    worst = max(float((grads[k] - expected_grads[k]).abs().max()) for k in grads)
    assert worst <= TOL
    assert max(float(g.abs().max()) for g in grads.values()) > 100 * TOL  # not vacuously small


def test_reference_logprobs_equal_the_unchunked_ones(tiny_models_dir: Path) -> None:
    agent = _agent(tiny_models_dir, LossConfig(beta=0.1, logprob_chunk_tokens=3))
    batch = _batch(agent.policy.config.vocab_size)
    ids = batch["input_ids"]
    torch.manual_seed(3)
    with torch.no_grad():
        for p in agent.policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the policy moved away from its reference
        ref = agent._reference[0](input_ids=ids, attention_mask=batch["attention_mask"])
        expected = token_logprobs(ref.logits[:, :-1], ids[:, 1:], TEMPERATURE)
    got = agent.reference_logprobs(ids, batch["attention_mask"])
    assert got is not None
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


class _LargestVocabTensor(TorchDispatchMode):
    """The most rows of any new tensor an op produces whose last dimension is the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in [*args, *(kwargs or {}).values()]
            if isinstance(t, torch.Tensor)
        }
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if not isinstance(tensor, torch.Tensor) or not tensor.dim():
                continue
            fresh = tensor.untyped_storage().data_ptr() not in inputs  # not a view of an input
            if fresh and tensor.shape[-1] == self.vocab:
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [4, 0])
def test_no_tensor_holds_more_than_a_chunk_of_logits(tiny_models_dir: Path, chunk: int) -> None:
    agent = _agent(tiny_models_dir, LossConfig(beta=0.05, logprob_chunk_tokens=chunk))
    vocab = agent.policy.config.vocab_size
    batch = _batch(vocab)
    tracker = _LargestVocabTensor(vocab)
    with tracker:
        agent.freeze_rollout(batch)
        loss, _ = agent.compute_loss(batch)
        loss.backward()
    if chunk:
        assert tracker.rows == chunk
    else:  # the unchunked computation: the whole micro-batch's logits at once
        assert tracker.rows == batch["input_ids"].numel()


def test_head_with_bias_and_bf16_hidden_states() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, dtype=torch.bfloat16, requires_grad=True)
    head = torch.nn.Linear(16, 50).to(torch.bfloat16)
    targets = torch.randint(0, 50, (2, 9))
    weights = torch.randn(2, 9)
    logprobs, entropy = chunked_logprobs_and_entropy(
        hidden, head.weight, targets, 1.3, 4, head.bias, with_entropy=True
    )
    (logprobs * weights).sum().backward()
    got = (hidden.grad, head.weight.grad, head.bias.grad)
    hidden.grad = head.weight.grad = head.bias.grad = None
    logits = head(hidden)
    expected = token_logprobs(logits, targets, 1.3)
    (expected * weights).sum().backward()
    assert entropy is not None and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, token_entropy(logits.detach(), 1.3), atol=1e-5, rtol=0)
    # bf16 gradients: the chunked path rounds once from fp32, autograd per matmul
    for mine, theirs in zip(got, (hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        assert mine is not None and theirs is not None and mine.dtype == torch.bfloat16
        torch.testing.assert_close(mine.float(), theirs.float(), atol=2e-2, rtol=2e-2)


def test_bf16_head_with_bias_at_a_realistic_shape() -> None:
    """A 4096 x 32000 bf16 head with a bias, chunked (4 chunks), against an fp64 reference.

    Tolerance, stated: bf16 rounds each logit to 8 significant bits, so a log-prob (target logit
    minus log-sum-exp) may be off by half an ulp of the largest |logit| twice: 2 x 2^-8 x max|logit|
    (0.15 nats at this shape's max |logit| of about 19; measured 0.023). Chunked and whole-logits
    paths must be equally far from fp64 (within 1e-3 nats of each other's error), and each
    gradient within 5% of the largest fp64 entry (bf16 products; measured 1-2.5%). About 4 s of
    CPU; the fp64 weight gradient is checked on every 64th vocabulary row to stay there.
    """
    import torch.nn.functional as F

    torch.manual_seed(0)
    hidden_size, vocab, tokens = 4096, 32000, 32
    hidden = torch.randn(1, tokens, hidden_size).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) * 0.05).to(torch.bfloat16).requires_grad_()
    bias = (torch.randn(vocab) * 2).to(torch.bfloat16).requires_grad_()  # logits of std ~4
    targets = torch.randint(0, vocab, (1, tokens))
    logprobs, _ = chunked_logprobs_and_entropy(hidden, weight, targets, 1.0, tokens // 4, bias)
    logprobs.sum().backward()
    assert hidden.grad is not None and weight.grad is not None and bias.grad is not None
    with torch.no_grad():
        whole = token_logprobs(F.linear(hidden, weight, bias), targets)
        h64, w64, b64 = (x.detach().double() for x in (hidden, weight, bias))
        logits64 = F.linear(h64, w64, b64)
        logp64 = torch.log_softmax(logits64, -1)
        ref = logp64.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        # d sum(log p(t)) / d logits = onehot(t) - softmax
        d_logits = -logp64.exp()
        d_logits.scatter_add_(-1, targets.unsqueeze(-1), torch.ones_like(ref).unsqueeze(-1))
        rows = torch.arange(0, vocab, 64)
        expected_grads = {
            "hidden": (hidden.grad, d_logits @ w64),
            "bias": (bias.grad, d_logits.sum((0, 1))),
            "weight": (weight.grad[rows], d_logits[0][:, rows].T @ h64[0]),
        }
    bound = 2 * 2**-8 * float(logits64.abs().max())
    chunk_error = float((logprobs.double() - ref).abs().max())
    whole_error = float((whole.double() - ref).abs().max())
    assert chunk_error <= bound, (chunk_error, bound)
    assert abs(chunk_error - whole_error) <= 1e-3, (chunk_error, whole_error)
    for name, (mine, exact) in expected_grads.items():
        relative = float((mine.double() - exact).abs().max() / exact.abs().max())
        assert relative <= 0.05, (name, relative)


def test_models_with_scaled_logits_fall_back_to_whole_logits(tiny_models_dir: Path) -> None:
    agent = _agent(tiny_models_dir, LossConfig())
    assert output_head(agent.policy) is agent.policy.lm_head
    agent.policy.config.logit_scale = 0.5  # e.g. Cohere: logits = head(hidden) * logit_scale
    assert output_head(agent.policy) is None
    with pytest.raises(ValueError, match="logprob_chunk_tokens must be >= 0"):
        replace(LossConfig(), logprob_chunk_tokens=-1)
