"""The grader: completions in, per-test verdicts and a reward out (LiveCodeBench semantics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from mars2.data.problem import Problem, TestCase
from mars2.sandbox.base import Job, JobResult, Sandbox, TestResult, Verdict
from mars2.sandbox.extract import extract_code

RewardKind = Literal["binary", "pass_rate"]
FEEDBACK_CAP = 300  # characters of a test's input / expected / actual shown in feedback


def clip(text: str, cap: int = FEEDBACK_CAP) -> str:
    """Shorten `text` to `cap` characters, saying how much was cut."""
    return text if len(text) <= cap else text[:cap] + f"... [{len(text) - cap} more chars]"


@dataclass(frozen=True)
class TestFeedback:
    """One test's verdict with truncated input, expected and actual output, for prompts and logs."""

    verdict: Verdict
    input: str
    expected: str
    actual: str
    error: str

    __test__ = False


@dataclass
class Grade:
    """Everything the search and the trainer need to know about one completion."""

    code: str | None
    public: list[TestFeedback] = field(default_factory=list)
    private: list[TestFeedback] = field(default_factory=list)
    reward: float = 0.0

    @property
    def has_code(self) -> bool:
        return self.code is not None

    @property
    def public_pass_rate(self) -> float:
        if not self.public:
            return 0.0
        return sum(t.verdict is Verdict.PASSED for t in self.public) / len(self.public)

    @property
    def private_passed(self) -> bool:
        return bool(self.private) and all(t.verdict is Verdict.PASSED for t in self.private)


def _feedback(tests: Sequence[TestCase], results: Sequence[TestResult]) -> list[TestFeedback]:
    return [
        TestFeedback(
            r.verdict, clip(t.input), clip(t.output), clip(r.actual), clip(r.error or r.stderr, 800)
        )
        for t, r in zip(tests, results, strict=True)
    ]


def reward_from(result: JobResult, kind: RewardKind) -> float:
    """All-pass binary reward, or the fraction of tests passed."""
    if kind == "binary":
        return 1.0 if result.all_passed else 0.0
    if kind == "pass_rate":
        return result.pass_rate
    raise ValueError(f"unknown reward kind {kind!r}: use 'binary' or 'pass_rate'")


class Grader:
    """Extracts code from completions and runs it on a problem's public and private tests at once.

    The reward comes from the private tests; public verdicts are what agents see as feedback.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        reward: RewardKind = "binary",
        early_stop: bool = False,
        per_test_timeout: float | None = None,
    ) -> None:
        if reward not in ("binary", "pass_rate"):
            raise ValueError(f"unknown reward kind {reward!r}: use 'binary' or 'pass_rate'")
        self.sandbox = sandbox
        self.reward_kind: RewardKind = reward
        self.early_stop = early_stop
        self.per_test_timeout = per_test_timeout

    def grade(self, items: Sequence[tuple[Problem, str]], with_public: bool = True) -> list[Grade]:
        """Grade (problem, completion) pairs in one sandbox batch."""
        codes = [extract_code(completion) for _, completion in items]
        return self.grade_code(
            [(p, c) for (p, _), c in zip(items, codes, strict=True)], with_public
        )

    def grade_code(
        self, items: Sequence[tuple[Problem, str | None]], with_public: bool = True
    ) -> list[Grade]:
        """Grade already-extracted code (None means the answer had no code)."""
        jobs: list[Job] = []
        slots: list[int] = []
        for index, (problem, code) in enumerate(items):
            if code is None:
                continue
            tests = (list(problem.public_tests) if with_public else []) + list(problem.all_tests)
            jobs.append(
                Job(
                    code=code,
                    kind=problem.test_kind.value,
                    tests=[{"input": t.input, "output": t.output} for t in tests],
                    fn_name=problem.fn_name,
                    per_test_timeout=self.per_test_timeout,
                    early_stop=self.early_stop,
                )
            )
            slots.append(index)
        results = self.sandbox.run_batch(jobs) if jobs else []
        grades = [Grade(code=None) for _ in items]
        for slot, result in zip(slots, results, strict=True):
            problem, code = items[slot]
            n_public = len(problem.public_tests) if with_public else 0
            public_part = JobResult(result.tests[:n_public])
            private_part = JobResult(result.tests[n_public:])
            grades[slot] = Grade(
                code=code,
                public=_feedback(problem.public_tests, public_part.tests) if with_public else [],
                private=_feedback(problem.all_tests, private_part.tests),
                reward=reward_from(private_part, self.reward_kind),
            )
        return grades
