"""A simulated environment for testing and benchmarking the search without models or a sandbox.

Agents have a known success probability per problem; a refinement of a failed answer succeeds with
``p + refine_boost * (1 - p)``. Completions carry their outcome in a comment that
`SimulatedGrader` reads back, so the whole search loop runs for real around them.

Simulated latency (optional): an agent given `lengths` draws each answer's token count from a
long-tailed distribution, and with a `latency` engine model a blocking `generate` call costs the
time that engine needs for the batch; the grader likewise with a `SandboxModel`. That time is
spent on a shared `VirtualClock` when one is given (deterministic, instant), else slept for real
scaled by `realtime` (0: no waiting at all; the pipelined driver's virtual clock then reads the
models itself). See `mars2.search.latency`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from mars2.data.problem import Problem, TestCase, TestKind
from mars2.generation.base import Completion, Messages
from mars2.sandbox.base import Verdict
from mars2.sandbox.records import Grade, TestFeedback
from mars2.search.latency import AnswerLengths, EngineModel, SandboxModel, VirtualClock
from mars2.search.services import tests_per_job

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
        self,
        skill: Callable[[str], float] | float,
        refine_boost: float = 0.3,
        seed: int = 0,
        lengths: AnswerLengths | None = None,
        latency: EngineModel | None = None,
        clock: VirtualClock | None = None,
        realtime: float = 0.0,
        name: str = "agent",
    ) -> None:
        self.skill = skill if callable(skill) else (lambda _pid, p=float(skill): p)
        self.refine_boost = refine_boost
        self.rng = np.random.default_rng(seed)
        self.lengths = lengths
        self.length_rng = np.random.default_rng([seed, 1])  # outcomes do not depend on lengths
        self.latency = latency
        self.clock = clock
        self.realtime = realtime
        self.name = name
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
            tokens, truncated = [1, 2, 3], False
            if self.lengths is not None:
                length, truncated = self.lengths.draw(self.length_rng)
                tokens = [1] * length
            out.append(
                Completion(text=text, token_ids=tokens, prompt_token_ids=[0], truncated=truncated)
            )
        if self.latency is not None:
            _wait(
                self.latency.makespan([len(c.token_ids) for c in out]),
                self.name,
                self.clock,
                self.realtime,
            )
        return out


class SimulatedGrader:
    """Reads the outcome a `SimulatedAgent` wrote; `reward="pass_rate"` returns the quality score."""

    def __init__(
        self,
        reward: str = "binary",
        latency: SandboxModel | None = None,
        clock: VirtualClock | None = None,
        realtime: float = 0.0,
    ) -> None:
        self.reward = reward
        self.latency = latency
        self.clock = clock
        self.realtime = realtime

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
        if self.latency is not None:
            tests = [tests_per_job(p) for p, _ in items]
            _wait(self.latency.makespan(tests), "sandbox", self.clock, self.realtime)
        return grades


def _wait(seconds: float, who: str, clock: VirtualClock | None, realtime: float) -> None:
    if clock is not None:
        clock.spend(who, seconds)
    elif realtime > 0:
        time.sleep(seconds * realtime)
