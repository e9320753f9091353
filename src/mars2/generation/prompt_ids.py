"""The one way a chat becomes prompt token ids, shared by every backend and the warm start."""

from __future__ import annotations

from typing import Any

from mars2.generation.base import Messages


def encode_prompt(
    tokenizer: Any, chat: Messages, max_prompt_tokens: int | None = None
) -> list[int]:
    """The tokenizer's chat template with the generation prompt, as a list of ids.

    A prompt longer than `max_prompt_tokens` keeps its end (the instructions and the question).
    """
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(
        ids["input_ids"] if hasattr(ids, "keys") else ids
    )  # newer transformers: BatchEncoding
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        ids = ids[-max_prompt_tokens:]
    return ids
