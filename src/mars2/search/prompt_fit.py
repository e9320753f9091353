"""Whether each problem's prompts fit every agent's prompt cap, decided before any model loads.

A refinement prompt is cut to fit (`mars2.generation.prompt.encode_prompt` shortens the previous
attempt's code); the root prompt (system prompt, statement, instructions) and the refinement of
an answer without code hold nothing to cut, so a row whose longer of the two is over a cap is
refused or left out here (``too_long`` on its data split) instead of failing mid-run. Whatever
else a refinement shows (the public tests' feedback) depends on the answers and is not known yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mars2.data.loaders import ROW
from mars2.data.problem import Problem
from mars2.generation.prompt import encode_prompt
from mars2.search.prompts import PromptBuilder
from mars2.utils.validation import ConfigError

# What a data split does with a row whose uncut prompts are over an agent's cap.
TooLong = Literal["refuse", "skip"]
TOO_LONG = ("refuse", "skip")


@dataclass(frozen=True)
class PromptCap:
    """One agent's tokenizer (with its chat template) and its `generation.max_prompt_tokens`."""

    agent: str
    tokenizer: Any
    max_prompt_tokens: int


@dataclass(frozen=True)
class TooLongRow:
    """A problem with a prompt that cannot be cut and is over one agent's cap."""

    problem: Problem
    cap: PromptCap
    length: int

    @property
    def where(self) -> str:
        row = self.problem.metadata.get(ROW)
        return f"{row} (problem {self.problem.id!r})" if row else f"problem {self.problem.id!r}"


def uncut_prompt_length(problem: Problem, prompts: PromptBuilder, tokenizer: Any) -> int:
    """Tokens of the longest prompt of the problem that cannot be cut (its root prompt, or the
    refinement of an answer without code), encoded as every generator encodes prompts."""
    return max(len(encode_prompt(tokenizer, chat)) for chat in prompts.uncut_messages(problem))


def fitting_problems(
    problems: Sequence[Problem],
    prompts: PromptBuilder,
    caps: Sequence[PromptCap],
    too_long: str,
    split: str,
    limit: int | None = None,
) -> tuple[list[Problem], list[TooLongRow]]:
    """The problems (in order, at most `limit`) whose uncut prompts fit every cap, and the rows
    left out (``too_long=skip``); with ``too_long=refuse`` the first row over a cap raises a
    `ConfigError` naming its file and line, the agent, the length, the cap and the fixes."""
    if too_long not in TOO_LONG:
        raise ConfigError(
            f"data.{split}.too_long={too_long} is not a choice: refuse (stop before the run, "
            "naming the row) or skip (leave such rows out, counted in the log)."
        )
    kept: list[Problem] = []
    left_out: list[TooLongRow] = []
    for problem in problems:
        if limit is not None and len(kept) >= limit:
            break
        over = _first_over(problem, prompts, caps)
        if over is None:
            kept.append(problem)
        elif too_long == "skip":
            left_out.append(over)
        else:
            raise ConfigError(_refusal(over, split))
    return kept, left_out


def _first_over(
    problem: Problem, prompts: PromptBuilder, caps: Sequence[PromptCap]
) -> TooLongRow | None:
    lengths: dict[int, int] = {}  # agents sharing one tokenizer encode each prompt once
    for cap in caps:
        key = id(cap.tokenizer)
        if key not in lengths:
            lengths[key] = uncut_prompt_length(problem, prompts, cap.tokenizer)
        if lengths[key] > cap.max_prompt_tokens:
            return TooLongRow(problem, cap, lengths[key])
    return None


def _refusal(row: TooLongRow, split: str) -> str:
    agent, limit = row.cap.agent, row.cap.max_prompt_tokens
    return (
        f"data.{split}: {row.where} makes a prompt of {row.length} tokens with agent {agent}'s "
        f"tokenizer and chat template, over agents.{agent}.generation.max_prompt_tokens={limit}; "
        "its root prompt (system prompt, statement, instructions) is never cut. Raise the cap "
        f"(agents.{agent}.generation.max_prompt_tokens={row.length} or more; the engine's "
        f"max_model_len follows it), or leave such rows out with data.{split}.too_long=skip "
        "(they are counted in the log)."
    )
