"""The generator interface every backend implements (transformers, vLLM, simulated)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

Messages = list[dict[str, str]]


@dataclass
class Completion:
    """One sampled answer with the token-level data the trainer needs."""

    text: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # per generated token, from the sampling policy
    truncated: bool = False  # hit max_new_tokens without an end-of-sequence token


@runtime_checkable
class Generator(Protocol):
    """Samples one completion per chat (the backend applies its own tokenizer's chat template)."""

    def generate(self, chats: Sequence[Messages]) -> list[Completion]: ...
