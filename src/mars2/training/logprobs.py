"""Per-token log-probs and entropy from final hidden states, a chunk of tokens at a time (plain torch).

The output head turns `[tokens, hidden]` into `[tokens, vocab]` logits: for a 16k-token completion
and a 152k vocabulary that is 9 GiB per fp32 copy, and the unchunked computation keeps several.
Here the head runs on `chunk` tokens at a time: forward keeps only each token's log-sum-exp, and
backward recomputes each chunk's logits, so a `[chunk, vocab]` block (and a few of its fp32
copies) is the largest temporary either way. The values are those of
`mars2.training.losses.token_logprobs` / `token_entropy` on the whole logits (same temperature
handling: `logits.float() / temperature`) up to rounding. In fp32 only the summation order differs
(the head's weight gradient is accumulated chunk by chunk in fp32). In bf16, and with a bias, the
head's output is rounded to bf16 per chunk: the matmul kernel and the point where the bias is added
can differ with the chunk's shape, so the two paths can differ by far more than summation order
(issue #43's review measured 0.18 nats on one token) while both stay equally far from the
fp64 value, within half a bf16 ulp of the largest logit on the target's logit and on the
log-sum-exp each (`tests/test_logprobs.py::test_bf16_head_with_bias_at_a_realistic_shape`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Tokens per chunk: 1024 x 152k vocabulary x 4 bytes is 0.6 GiB per fp32 block.
DEFAULT_CHUNK_TOKENS = 1024


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    # the unchunked path's arithmetic: the head in the model's dtype, then float, then temperature
    # (in place: the same division, one [chunk, vocab] buffer fewer)
    return F.linear(hidden, weight, bias).float().div_(temperature)


class _ChunkedHead(torch.autograd.Function):
    """log p(target) (and the entropy) of `hidden @ weight.T + bias`, chunk by chunk.

    Forward keeps each token's log-sum-exp only; backward recomputes each chunk's logits. The
    entropy is a metric: it carries no gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # outputs shaped like `targets` (not views of flat ones: FSDP2 warns about returned views)
        device, shape = hidden.device, targets.shape
        flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        count = flat_targets.shape[0]
        logprobs = torch.empty(shape, dtype=torch.float32, device=device)
        entropy = torch.empty(shape if with_entropy else (0,), dtype=torch.float32, device=device)
        flat_logprobs, flat_entropy = logprobs.view(-1), entropy.view(-1)
        lse = torch.empty(count, dtype=torch.float32, device=device)
        for start in range(0, count, chunk):
            end = min(start + chunk, count)
            # log_softmax's own steps (x - max - log sum exp(x - max)), in place on one buffer
            logp = _scaled_logits(flat_hidden[start:end], weight, bias, temperature)
            top = logp.amax(dim=-1, keepdim=True)
            logp.sub_(top)
            log_total = logp.exp().sum(dim=-1, keepdim=True).log_()
            logp.sub_(log_total)
            lse[start:end] = (top + log_total).squeeze(-1)
            picked = logp.gather(-1, flat_targets[start:end].unsqueeze(-1)).squeeze(-1)
            flat_logprobs[start:end] = picked
            if with_entropy:  # -sum p log p as a row-wise dot product: no [chunk, vocab] product
                p = logp.exp().unsqueeze(-2)
                flat_entropy[start:end] = -torch.matmul(p, logp.unsqueeze(-1)).reshape(-1)
                del p
            del logp  # before the next chunk's logits exist
        ctx.save_for_backward(flat_hidden, weight, bias, flat_targets, lse)
        ctx.temperature, ctx.chunk, ctx.hidden_shape = temperature, chunk, hidden.shape
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32 accumulators, rounded to the parameter's dtype once at the end
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_weight
            else None
        )
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_bias and bias is not None
            else None
        )
        grad = grad.reshape(-1).float()
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            logits = _scaled_logits(h, weight, bias, temperature)
            # d log p(t) / d logits = (onehot(t) - softmax) / temperature
            d_logits = logits.sub_(lse[start:end].unsqueeze(-1)).exp_()
            g = grad[start:end].unsqueeze(-1)
            d_logits.mul_(-g).scatter_add_(-1, targets[start:end].unsqueeze(-1), g)
            d_logits.div_(temperature)
            if grad_bias is not None:
                grad_bias += d_logits.sum(0)
            if grad_hidden is not None:
                torch.matmul(d_logits.to(hidden.dtype), weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.addmm_(d_logits.t(), h.float())
            del logits, d_logits  # before the next chunk's logits exist
        return (
            grad_hidden.view(ctx.hidden_shape) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
        )


def chunked_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    bias: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy or None) per position, fp32, from final hidden states [..., H].

    `weight` [V, H] (and `bias` [V]) is the output head, `targets` [...] the next tokens.
    Differentiable in `hidden`, `weight` and `bias` (not the entropy, a metric); nothing of size
    [tokens, vocab] is kept between forward and backward.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    logprobs, entropy = _ChunkedHead.apply(
        hidden, weight, bias, targets, float(temperature), int(chunk), with_entropy
    )
    return logprobs, entropy if with_entropy else None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(target) per position (see `chunked_logprobs_and_entropy`)."""
    return chunked_logprobs_and_entropy(hidden, weight, targets, temperature, chunk, bias)[0]
