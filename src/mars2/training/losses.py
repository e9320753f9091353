"""GRPO-family policy losses on padded token tensors (plain torch, no Lightning).

All tensors are [batch, tokens] over completion tokens; `mask` is 1 on real completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mars2.training.logprobs import DEFAULT_CHUNK_TOKENS

LossVariant = Literal["grpo", "dr_grpo", "dapo", "gspo"]


@dataclass(frozen=True)
class LossConfig:
    """Which loss and its coefficients.

    grpo: per-token clipped ratio, mean over each sequence's tokens, then over sequences.
    dr_grpo: the same sum divided by batch size x `max_tokens` (no length normalisation bias).
    dapo: token-level mean over all tokens of the step, clip-higher (eps_low < eps_high).
    gspo: one ratio per sequence, exp(mean token log-ratio), clipped (use small eps, ~3e-4);
    its gradient is s_i·A_i·mean_t ∇log π(y_t) (GSPO paper, eq. 10), unless clipped.
    beta: coefficient of the k3 KL estimator to the reference model (0 disables the reference).
    tis_cap: truncated importance sampling cap on exp(old - rollout) when rollout log-probs come
    from another engine (vLLM); None disables it.
    overlong_buffer, overlong_penalty: DAPO's soft overlong penalty, a reward term (not a loss
    term; see `mars2.rewards.overlong`) over the last `overlong_buffer` tokens before the agent's
    `max_new_tokens`, reaching -overlong_penalty at the cap; buffer 0 disables it.
    logprob_chunk_tokens: the policy, old-policy and reference log-probs (and the entropy metric)
    apply the output head to this many tokens at a time, so no [tokens, vocab] logits are held
    (see `mars2.training.logprobs`); 0 computes the whole micro-batch's logits at once.
    """

    variant: LossVariant = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    tis_cap: float | None = 2.0
    max_tokens: int = 1024
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.variant not in ("grpo", "dr_grpo", "dapo", "gspo"):
            raise ValueError(
                f"unknown loss variant {self.variant!r}: use grpo, dr_grpo, dapo or gspo"
            )
        if self.eps_low < 0 or self.eps_high < 0 or self.beta < 0:
            raise ValueError("eps_low, eps_high and beta must be >= 0")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError("overlong_buffer and overlong_penalty must be >= 0")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or null to disable it), got {self.tis_cap}")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(
                "logprob_chunk_tokens must be >= 0 (0: whole logits), got "
                f"{self.logprob_chunk_tokens}"
            )


# The k3 log-ratio ref - lp is clamped to [-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND] before exp:
# exp(20) ≈ 4.9e8 is finite in fp32 and bf16, and a token 20 nats off the reference is already an
# outlier whose gradient is better lost than allowed to dominate the step (peers clamp the same term).
K3_LOG_RATIO_BOUND = 20.0


def k3_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1 with d = ref - lp,
    d clamped to [-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND]; 0 where `mask` is 0."""
    delta = ref_logprobs - logprobs
    if mask is not None:
        # Mask before exp: a padded position with d = 100 would give exp(100) = inf in fp32, and
        # inf * 0 = NaN poisons the whole loss (and its gradient) however it is masked afterwards.
        delta = torch.where(mask.bool(), delta, torch.zeros_like(delta))
    # Clamp before exp too: a real token at d > 88 overflows fp32 the same way.
    delta = delta.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.exp(delta) - delta - 1.0


def _aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    variant: LossVariant,
    max_tokens: int,
    num_sequences: float | None,
    num_tokens: float | None,
) -> torch.Tensor:
    sequences = float(mask.shape[0]) if num_sequences is None else num_sequences
    if variant == "grpo" or variant == "gspo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(sequences, 1)
    if variant == "dapo":
        tokens = mask.sum() if num_tokens is None else torch.tensor(num_tokens)
        return (per_token * mask).sum() / tokens.clamp(min=1)
    return (per_token * mask).sum() / (max(sequences, 1) * max_tokens)  # dr_grpo


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to minimise and detached metrics: kl, clip_fraction (tokens whose gradient the
    clip removes: ratio above 1+ε_high with A > 0, below 1−ε_low with A < 0), ratio_outside_band
    (ratio outside [1−ε_low, 1+ε_high] whatever the sign of A) and the mean ratio.

    `num_sequences` and `num_tokens` are the sizes of the whole optimizer step (all micro-batches,
    all ranks; default: this batch). With them the step's loss, and so its gradient, is the sum of
    the micro-batch losses whatever the micro-batch size.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.unsqueeze(-1)
    log_ratio = logprobs - old_logprobs
    if config.variant == "gspo":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        # GSPO-token form: value s_i, gradient sg(s_i)·∇lp_t per token. Without the detach every
        # token would also carry s_i·∇(mean lp), doubling the sequence's gradient.
        log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if rollout_logprobs is not None and config.tis_cap is not None:
        weight = torch.exp(old_logprobs - rollout_logprobs).clamp(max=config.tis_cap).detach()
        per_token = per_token * weight
    sizes = (config.max_tokens, num_sequences, num_tokens)
    loss = _aggregate(per_token, mask, config.variant, *sizes)
    metrics: dict[str, torch.Tensor] = {}
    if config.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs reference log-probs")
        kl = k3_kl(logprobs, ref_logprobs, mask)
        loss = loss + config.beta * _aggregate(kl, mask, config.variant, *sizes)
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        # Clipped where min() took the clipped term: its gradient is gone (TRL's and verl's count).
        removed = ((clipped * adv) < (ratio * adv)).to(mask.dtype)
        metrics["clip_fraction"] = (removed * mask).sum() / tokens
        outside = ((ratio - clipped).abs() > 1e-8).to(mask.dtype)  # either sign of advantage
        metrics["ratio_outside_band"] = (outside * mask).sum() / tokens
        metrics["ratio"] = (ratio * mask).sum() / tokens
    return loss, metrics


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) per position from logits [B, T, V] (already aligned with targets [B, T])."""
    logits = logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the sampling distribution per position."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)
