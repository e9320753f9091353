"""The one prompt encoder every backend and the warm start use."""

from __future__ import annotations

from typing import Any

from mars2.generation.base import Messages


def encode_prompt(
    tokenizer: Any, chat: Messages, max_prompt_tokens: int | None = None
) -> list[int]:
    """Token ids of `chat` in the tokenizer's chat template, ready for the assistant's answer.

    A prompt longer than `max_prompt_tokens` keeps its end: the instructions and the question.
    """
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    ids = list(ids)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        ids = ids[-max_prompt_tokens:]
    return ids
