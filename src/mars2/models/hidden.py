"""A causal LM's final hidden states and output head, without materialising its logits.

`final_hidden_states(model, ...)` runs the model's own forward (so FSDP's, peft's and gradient
checkpointing's hooks all run as usual) with the output head bypassed for that one call, and
returns the states the head would have turned into logits, plus the head. Chunked log-probs
(`mars2.training.logprobs`) then apply the head a chunk of tokens at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Config keys of models whose logits are more than `lm_head(hidden)` (scaled or soft-capped).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_head(model: Any) -> torch.nn.Linear | None:
    """The model's output head when its logits are exactly `head(final hidden states)`, else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _LOGIT_TRANSFORMS):
        return None
    return head


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@contextlib.contextmanager
def _bypassed(head: torch.nn.Module) -> Iterator[None]:
    own = head.__dict__.get("forward")
    head.forward = _identity  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def final_hidden_states(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, head: torch.nn.Linear
) -> torch.Tensor:
    """The [B, T, H] states `head` (from `output_head(model)`) maps to the model's logits."""
    with _bypassed(head):
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if hidden.shape[-1] != head.in_features:
        raise RuntimeError(
            f"{type(model).__name__} did not hand its output head the final hidden states "
            f"(got width {hidden.shape[-1]}, head takes {head.in_features})"
        )
    return hidden
