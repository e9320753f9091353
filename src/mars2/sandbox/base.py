"""The sandbox interface: a batch of (code, tests) jobs in, per-test verdicts out."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mars2.sandbox.protocol import ResultRow
from mars2.sandbox.runner import harness


class Verdict(str, Enum):
    """The outcome of one test."""

    PASSED = harness.PASSED
    WRONG_ANSWER = harness.WRONG_ANSWER
    TIMEOUT = harness.TIMEOUT
    RUNTIME_ERROR = harness.RUNTIME_ERROR
    MEMORY_EXCEEDED = harness.MEMORY_EXCEEDED
    OUTPUT_LIMIT = harness.OUTPUT_LIMIT
    COMPILE_ERROR = harness.COMPILE_ERROR
    SKIPPED = harness.SKIPPED
    # The wall-clock safety net tripped while the answer was starved of CPU by other load, even
    # after a retry: says nothing about the answer (never a failing verdict of its own).
    OVERLOADED = harness.OVERLOADED
    # The infrastructure failed (a worker killed mid-job, a sandbox that could not be created or
    # reached): says nothing about the answer, which is excluded from rewards and counted.
    INFRA_ERROR = harness.INFRA_ERROR


@dataclass(frozen=True)
class Job:
    """Run `code` against `tests` (dicts with 'input' and 'output') of kind stdin / call / humaneval."""

    code: str
    kind: str
    tests: Sequence[dict[str, str]]
    fn_name: str | None = None
    per_test_timeout: float | None = None
    job_timeout: float | None = None
    early_stop: bool = False
    profile: str = "lenient"  # grading profile, see mars2.sandbox.verdict.compare

    def payload(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The JSON-ready form a worker reads, with the sandbox's defaults filled in."""
        return {
            "code": self.code,
            "kind": self.kind,
            "tests": list(self.tests),
            "fn_name": self.fn_name,
            "per_test_timeout": self.per_test_timeout or defaults["per_test_timeout"],
            "job_timeout": self.job_timeout or defaults["job_timeout"],
            "early_stop": self.early_stop,
            "profile": self.profile,
            "output_limit": defaults["output_limit"],
        }


@dataclass(frozen=True)
class TestResult:
    """One test's verdict with the (truncated) evidence that feeds refinement prompts."""

    index: int
    verdict: Verdict
    actual: str = ""
    error: str = ""
    stderr: str = ""
    seconds: float = 0.0

    __test__ = False

    @classmethod
    def from_row(cls, row: ResultRow) -> TestResult:
        return cls(
            index=row.index,
            verdict=Verdict(row.verdict),
            actual=row.actual,
            error=row.error,
            stderr=row.stderr,
            seconds=row.time,
        )


@dataclass
class JobResult:
    """All verdicts of one job, in test order."""

    tests: list[TestResult] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(t.verdict is Verdict.PASSED for t in self.tests)

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and self.passed == len(self.tests)

    @property
    def pass_rate(self) -> float:
        return self.passed / len(self.tests) if self.tests else 0.0

    @property
    def infra_error(self) -> bool:
        """A test's verdict came from a fault of ours (infrastructure, or a host so loaded that a
        test was starved of CPU): the result says nothing about the answer."""
        return any(t.verdict in (Verdict.INFRA_ERROR, Verdict.OVERLOADED) for t in self.tests)

    @classmethod
    def failed(cls, count: int, verdict: Verdict, error: str) -> JobResult:
        """Every test of a job that could not run gets the same verdict and reason."""
        return cls([TestResult(i, verdict, error=error) for i in range(count)])


def results_from_rows(
    rows: Sequence[ResultRow | None], count: int, missing_error: str
) -> JobResult:
    """Turn judged rows (None where a test was never reported) into a `JobResult`."""
    tests = []
    for index in range(count):
        row = rows[index] if index < len(rows) else None
        if row is None:
            tests.append(TestResult(index, Verdict.RUNTIME_ERROR, error=missing_error))
        else:
            tests.append(TestResult.from_row(row))
    return JobResult(tests)


# Defaults every sandbox shares (LiveCodeBench uses 6 s per test).
PER_TEST_TIMEOUT = 6.0
JOB_TIMEOUT = 60.0
OUTPUT_LIMIT_MB = 1.0


class Sandbox(ABC):
    """Runs jobs. `run_batch` is the synchronous core; `run` is the same for asyncio callers."""

    @abstractmethod
    def run_batch(self, jobs: Sequence[Job]) -> list[JobResult]:
        """Run every job (concurrently where the backend can) and return results in job order."""

    async def run(self, jobs: Sequence[Job]) -> list[JobResult]:
        return await asyncio.to_thread(self.run_batch, jobs)

    def close(self) -> None:
        """Release workers or remote sessions."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
