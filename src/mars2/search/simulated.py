"""A simulated environment for testing and benchmarking the search without models or a sandbox.

Agents have a known success probability per problem; a refinement of a failed answer succeeds with
``p + refine_boost * (1 - p)``. Completions carry their outcome in a comment that
`SimulatedGrader` reads back, so the whole search loop runs for real around them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from mars2.data.problem import Problem, TestCase, TestKind
from mars2.generation.base import Completion, Messages
from mars2.sandbox.base import Verdict
from mars2.sandbox.grader import Grade, TestFeedback

_PROBLEM_TAG = re.compile(r"\[sim:([^\]]+)\]")
_OUTCOME = re.compile(r"# outcome: (\w+) ([0-9.]+)")


def simulated_problems(count: int, prefix: str = "sim") -> list[Problem]:
    """Problems whose statements carry their id, so simulated agents can look up their skill."""
    return [
        Problem(
            id=f"{prefix}/{i}",
            statement=f"[sim:{prefix}/{i}] Print the answer.",
            test_kind=TestKind.STDIN,
            public_tests=(TestCase("0", "1"),),
            private_tests=(TestCase("1", "2"),),
        )
        for i in range(count)
    ]


class SimulatedAgent:
    """A generator whose answers pass with probability `skill(problem_id)` (higher when refining)."""

    def __init__(
        self, skill: Callable[[str], float] | float, refine_boost: float = 0.3, seed: int = 0
    ) -> None:
        self.skill = skill if callable(skill) else (lambda _pid, p=float(skill): p)
        self.refine_boost = refine_boost
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def success_probability(self, chat: Messages) -> float:
        text = chat[-1]["content"]
        match = _PROBLEM_TAG.search(text)
        if match is None:
            raise ValueError("not a simulated problem: no [sim:...] tag in the prompt")
        p = float(self.skill(match.group(1)))
        if "A previous attempt" in text:
            p = p + self.refine_boost * (1.0 - p)
        return p

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        self.calls += 1
        out = []
        for chat in chats:
            passed = bool(self.rng.random() < self.success_probability(chat))
            quality = 1.0 if passed else float(self.rng.random() * 0.5)
            text = (
                f"```python\n# outcome: {'pass' if passed else 'fail'} {quality:.3f}\nprint(1)\n```"
            )
            out.append(Completion(text=text, token_ids=[1, 2, 3], prompt_token_ids=[0]))
        return out


class SimulatedGrader:
    """Reads the outcome a `SimulatedAgent` wrote; `reward="pass_rate"` returns the quality score."""

    def __init__(self, reward: str = "binary") -> None:
        self.reward = reward

    def grade(self, items: Sequence[tuple[Problem, str]]) -> list[Grade]:
        grades = []
        for problem, completion in items:
            match = _OUTCOME.search(completion)
            if match is None:
                grades.append(Grade(code=None))
                continue
            passed = match.group(1) == "pass"
            verdict = Verdict.PASSED if passed else Verdict.WRONG_ANSWER
            test = problem.public_tests[0]
            feedback = TestFeedback(verdict, test.input, test.output, "1" if passed else "0", "")
            reward = (
                1.0 if passed else (float(match.group(2)) if self.reward == "pass_rate" else 0.0)
            )
            grades.append(
                Grade(code=completion, public=[feedback], private=[feedback], reward=reward)
            )
        return grades
