"""A causal LM's forward with its output head replaced for one call, so no logits are materialised.

`forward_with_head(model, head, compute, ...)` runs the model's own forward (so FSDP's, peft's and
gradient checkpointing's hooks all run as usual) with `head(hidden)` replaced by
`compute(hidden)`, and returns what `compute` returned. Running inside the forward matters under
FSDP2: the output head's weight is whole (all-gathered) only while the root module's forward and
backward run. Chunked log-probs (`mars2.training.logprobs`) use this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def _replaced(
    head: torch.nn.Module, compute: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    own = head.__dict__.get("forward")
    head.forward = compute  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def forward_with_head(
    model: Any,
    head: torch.nn.Linear,
    compute: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """`compute([B, T, H] final hidden states)`, evaluated where the model would apply `head`
    (from `output_head(model)`) to them."""
    seen: list[int] = []

    def checked(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.shape[-1])
        return compute(hidden)

    with _replaced(head, checked):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if seen != [head.in_features]:
        raise RuntimeError(
            f"{type(model).__name__} did not hand its output head the final hidden states once "
            f"(widths seen: {seen}, the head takes {head.in_features})"
        )
    return out
