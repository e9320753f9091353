"""The `reference` backend: every prompt is answered with its problem's reference solution.

`mars2-eval ... generation.backend=reference` runs a data file and the grader end to end with
answers known to be right, so anything short of pass@1 = 1.0 points at the data (a wrong test, a
missing function name) or the grader, never at a model. No model is loaded.

Each chat is traced to the id of the problem it was rendered from: the `AnswerKey` holds every
problem's exact fresh prompt (which every refinement prompt of that problem begins with) and
looks the answer up by that id. Two problems with the same prompt but different solutions, or a
problem without a reference solution, are refused when the key is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mars2.data.problem import Problem
from mars2.generation.base import Completion, Messages
from mars2.generation.config import GenerationConfig

REFERENCE_FIELDS = ("canonical_solution", "reference_solution")


def reference_solution(problem: Problem) -> str:
    """The solution a problem ships with (HumanEval's canonical one, the toy sets' reference, a
    data file's ``reference_solution`` field)."""
    for key in REFERENCE_FIELDS:
        if problem.metadata.get(key):
            return str(problem.metadata[key])
    raise KeyError(f"problem {problem.id!r} ships no reference solution")


def has_reference(problem: Problem) -> bool:
    return any(problem.metadata.get(key) for key in REFERENCE_FIELDS)


class AnswerKeyError(ValueError):
    """Problems the reference backend cannot answer; the message names them."""


@dataclass(frozen=True)
class AnswerKey:
    """Problem id -> reference solution, and each problem's fresh prompt -> its id."""

    answers: dict[str, str]
    prompts: dict[str, str]

    @classmethod
    def of(cls, problems: Sequence[Problem], prompts: Mapping[str, str]) -> AnswerKey:
        """The key of `problems`, whose fresh prompt texts (by id) are `prompts`."""
        missing = [p.id for p in problems if not has_reference(p)]
        if missing:
            raise AnswerKeyError(
                f"{len(missing)} of {len(problems)} problems ship no reference solution (first: "
                f"{', '.join(missing[:3])}); the reference backend needs one per problem "
                f"(metadata {' or '.join(REFERENCE_FIELDS)}, or a reference_solution field in "
                "the data file)."
            )
        answers = {p.id: reference_solution(p) for p in problems}
        by_prompt: dict[str, str] = {}
        for problem in problems:
            text = prompts[problem.id]
            other = by_prompt.setdefault(text, problem.id)
            if other != problem.id and answers[other] != answers[problem.id]:
                raise AnswerKeyError(
                    f"problems {other!r} and {problem.id!r} have the same prompt but different "
                    "reference solutions: no answer can be traced to one of them."
                )
        return cls(answers, by_prompt)

    def problem_id(self, chat: Messages) -> str:
        """The id of the problem `chat` asks about: the longest fresh prompt that is the chat's
        last message or the start of it (a refinement)."""
        text = chat[-1]["content"]
        found = self.prompts.get(text)
        if found is not None:
            return found
        best = max(
            (p for p in self.prompts if text.startswith(p + "\n")), key=len, default=None
        )  # fmt: skip
        if best is None:
            raise LookupError(
                f"the reference backend got a prompt of no problem of this run: {text[:120]!r}..."
            )
        return self.prompts[best]


class ReferenceGenerator:
    """Answers every chat with the reference solution of its problem, in one python block."""

    overlaps_updates = True  # no weights: nothing an update could change under it

    def __init__(self, key: AnswerKey) -> None:
        self.key = key

    def answer(self, problem_id: str) -> str:
        return self.key.answers[problem_id]

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        return [
            Completion(text=f"```python\n{self.answer(self.key.problem_id(c)).strip()}\n```\n")
            for c in chats
        ]

    def sync_weights(self, policy: object) -> None:
        """Nothing to sync: the answers do not depend on any weights."""


@dataclass
class ModelFreeSource:
    """An agent as the reference backend sees it: a name and its generation settings, no model."""

    name: str
    generation_config: GenerationConfig
    model_spec: Any = None
    tokenizer: Any = None
    policy: Any = None
    weights_version: int = 0
