"""What a graded completion leaves behind: per-test feedback and the grade the search keeps.

Plain records, so that the search, the rewards and the reports can hold grades without importing
the grader service (`mars2.sandbox.verdict.grader`) that makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mars2.sandbox.base import Verdict


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
    """Everything the search and the trainer need to know about one completion.

    `public` holds the public tests' verdicts (what agents may see), `private` the private tests'
    (empty when they were not run). `passed` says whether every test the reward counts passed;
    None (graders that do not set it) means "every private test passed".
    """

    code: str | None
    public: list[TestFeedback] = field(default_factory=list)
    private: list[TestFeedback] = field(default_factory=list)
    reward: float = 0.0
    passed: bool | None = None
    infra_error: bool = False

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
        """Solved by the grader's own test set (the name predates public-only grading)."""
        if self.passed is not None:
            return self.passed
        return bool(self.private) and all(t.verdict is Verdict.PASSED for t in self.private)
