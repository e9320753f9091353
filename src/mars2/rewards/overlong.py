"""DAPO's soft overlong penalty: a reward term that grows linearly over a buffer before the cap."""

from __future__ import annotations

from dataclasses import dataclass


def soft_overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """The reward added to a completion of `length` tokens under a cap of `max_tokens`.

    0 up to ``max_tokens - buffer``; then linear from 0 down to ``-penalty`` at ``max_tokens``;
    ``-penalty`` beyond (DAPO, eq. 13). ``buffer = 0`` disables it.
    """
    if length < 0 or max_tokens < 1 or buffer < 0 or penalty < 0:
        raise ValueError("length, buffer and penalty must be >= 0 and max_tokens >= 1")
    if buffer > max_tokens:
        raise ValueError(f"overlong buffer {buffer} exceeds the length cap {max_tokens}")
    if buffer == 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length >= max_tokens:
        return -penalty
    return penalty * (start - length) / buffer


@dataclass(frozen=True)
class OverlongPenalty:
    """One agent's soft overlong penalty: its generation cap, buffer and size, in tokens."""

    max_tokens: int
    buffer: int
    penalty: float = 1.0

    def __post_init__(self) -> None:
        soft_overlong_penalty(0, self.max_tokens, self.buffer, self.penalty)  # validates

    def __call__(self, length: int) -> float:
        return soft_overlong_penalty(length, self.max_tokens, self.buffer, self.penalty)
