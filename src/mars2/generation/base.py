"""The generator interface every backend implements (transformers, vLLM, simulated)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    weights_version: int | None = None  # the sampler's weights when it was asked (server backends)
    prompt_cut: bool = False  # the prompt was cut to fit generation.max_prompt_tokens


@runtime_checkable
class Generator(Protocol):
    """Samples one completion per chat (the backend applies its own tokenizer's chat template)."""

    def generate(self, chats: Sequence[Messages]) -> list[Completion]: ...


# A streaming generator reports each finished request: (index in the submitted chats, completion),
# or (index, exception) when that request failed.
DoneCallback = Callable[[int, "Completion | BaseException"], None]


@runtime_checkable
class StreamingGenerator(Protocol):
    """A generator that accepts prompts while it is generating (e.g. vLLM's async engine).

    The pipelined search driver keeps at most `max_in_flight` requests submitted and not yet done,
    submitting more as each finishes. `submit` must return at once; `done` may be called from any
    thread (also from inside `submit`), once per submitted chat. Such a generator still implements
    the blocking `generate` for the round-synchronous driver and for evaluation.
    """

    max_in_flight: int

    def generate(self, chats: Sequence[Messages]) -> list[Completion]: ...

    def submit(self, chats: Sequence[Messages], done: DoneCallback) -> None: ...
