"""The one prompt encoder every backend and the warm start use."""

from __future__ import annotations

from typing import Any

from mars2.generation.base import Completion, Messages

# A message may name the part of its content that can be shortened to fit `max_prompt_tokens`
# (a refinement prompt's previous code); nothing else of a prompt is ever cut.
CUTTABLE = "cuttable"
CUT_MARK = "\n# ... (cut to fit the prompt)"


def _encode(tokenizer: Any, chat: Messages) -> list[int]:
    plain = [{k: v for k, v in message.items() if k != CUTTABLE} for message in chat]
    ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_prompt(
    tokenizer: Any, chat: Messages, max_prompt_tokens: int | None = None
) -> list[int]:
    """Token ids of `chat` in the tokenizer's chat template, ready for the assistant's answer.

    A prompt longer than `max_prompt_tokens` loses the end of its cuttable part (the previous
    attempt's code in a refinement prompt), as little as makes it fit; the system prompt, the
    statement and the instructions are never cut. A prompt that cannot fit that way is refused.
    """
    return encode_prompt_noting_cut(tokenizer, chat, max_prompt_tokens)[0]


def encode_prompt_noting_cut(
    tokenizer: Any, chat: Messages, max_prompt_tokens: int | None = None
) -> tuple[list[int], bool]:
    """`encode_prompt`'s ids, and whether the prompt was cut to fit (generators mark their
    completions with it, `Completion.prompt_cut`, and each step counts them)."""
    ids = _encode(tokenizer, chat)
    if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
        return ids, False
    return _cut(tokenizer, chat, max_prompt_tokens, len(ids)), True


def marked(completions: list[Completion], cuts: list[bool]) -> list[Completion]:
    """`completions`, each marked with whether its prompt was cut (`Completion.prompt_cut`)."""
    for completion, cut in zip(completions, cuts, strict=True):
        completion.prompt_cut = cut
    return completions


def _cut(tokenizer: Any, chat: Messages, max_prompt_tokens: int, length: int) -> list[int]:
    where = [
        i for i, m in enumerate(chat) if m.get(CUTTABLE) and m[CUTTABLE] in m.get("content", "")
    ]
    if not where:
        raise _too_long(length, max_prompt_tokens, cuttable=False)
    index = where[-1]
    message = chat[index]
    part, content = message[CUTTABLE], message["content"]
    start = content.rfind(part)

    def shortened(keep: int) -> list[int]:
        text = content[:start] + part[:keep] + CUT_MARK + content[start + len(part) :]
        return _encode(tokenizer, [*chat[:index], {**message, "content": text}, *chat[index + 1 :]])

    best = shortened(0)
    if len(best) > max_prompt_tokens:
        raise _too_long(len(best), max_prompt_tokens, cuttable=True)
    low, high = 0, len(part)  # the longest head of `part` that fits
    while low < high:
        middle = (low + high + 1) // 2
        attempt = shortened(middle)
        if len(attempt) <= max_prompt_tokens:
            low, best = middle, attempt
        else:
            high = middle - 1
    line_end = part.rfind("\n", 0, low) + 1  # end on a whole line where that still fits
    if 0 < line_end < low:
        attempt = shortened(line_end)
        if len(attempt) <= max_prompt_tokens:
            best = attempt
    return best


def _too_long(length: int, limit: int, cuttable: bool) -> ValueError:
    how = " even with the previous attempt's code cut out" if cuttable else ""
    return ValueError(
        f"the prompt takes {length} tokens{how}, over generation.max_prompt_tokens={limit}: the "
        "system prompt, the problem statement and the instructions are never cut. Raise "
        "max_prompt_tokens, or leave out problems this long before the run starts with "
        "too_long=skip on their data split (e.g. data.train.too_long=skip; see docs/data.md)."
    )
