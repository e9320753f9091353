"""The grader: completions in, per-test verdicts and a reward out.

Which tests count:

- ``reward_tests="all"`` (the default): public and private tests together decide the reward and
  whether an answer is solved -- the set LiveCodeBench's final verdict uses. HumanEval-kind
  problems are the exception: their public tests are examples lifted from the docstring, and the
  official verdict is the check function alone (the private test).
- ``reward_tests="public"``: only the public tests run; the private ones are never executed, so a
  search driven by this grader cannot learn anything about them. Evaluation search uses this view
  (`Grader.public_view`) and judges its final answers with a full grader afterwards.

How outputs are compared is the grading profile's business (`mars2.sandbox.verdict.compare`): the grader's
`profile`, else the problem's ``metadata["grading_profile"]``, else ``lenient``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

from mars2.data.problem import Problem, TestCase, TestKind
from mars2.sandbox.base import Job, JobResult, Sandbox, TestResult
from mars2.sandbox.records import Grade, TestFeedback
from mars2.sandbox.verdict.compare import DEFAULT_PROFILE, clip, get_profile
from mars2.sandbox.verdict.extract import extract_code

RewardKind = Literal["binary", "pass_rate"]
RewardTests = Literal["all", "public"]
log = logging.getLogger(__name__)
FEEDBACK_CAP = 300  # characters of a test's input / expected / actual shown in feedback
ERROR_CAP = 800


def _feedback(tests: Sequence[TestCase], results: Sequence[TestResult]) -> list[TestFeedback]:
    return [
        TestFeedback(
            r.verdict,
            clip(t.input, FEEDBACK_CAP),
            clip(t.output, FEEDBACK_CAP),
            clip(r.actual, FEEDBACK_CAP),
            clip(r.error or r.stderr, ERROR_CAP),
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


def profile_of(problem: Problem, override: str | None = None) -> str:
    """The grading profile for `problem`: the override, the problem's own, or the default."""
    name = override or problem.metadata.get("grading_profile") or DEFAULT_PROFILE
    return get_profile(str(name)).name


def hidden_tests(problem: Problem) -> tuple[TestCase, ...]:
    """Private tests that are not also public (some sources repeat the public ones)."""
    public = set(problem.public_tests)
    return tuple(t for t in problem.private_tests if t not in public)


class Grader:
    """Extracts code from completions and runs it on a problem's tests in one sandbox batch."""

    def __init__(
        self,
        sandbox: Sandbox,
        reward: RewardKind = "binary",
        early_stop: bool = False,
        per_test_timeout: float | None = None,
        reward_tests: RewardTests = "all",
        profile: str | None = None,
        dedupe: bool = False,
    ) -> None:
        if reward not in ("binary", "pass_rate"):
            raise ValueError(f"unknown reward kind {reward!r}: use 'binary' or 'pass_rate'")
        if reward_tests not in ("all", "public"):
            raise ValueError(f"unknown reward_tests {reward_tests!r}: use 'all' or 'public'")
        if profile is not None:
            get_profile(profile)
        self.sandbox = sandbox
        self.reward_kind: RewardKind = reward
        self.early_stop = early_stop
        self.per_test_timeout = per_test_timeout
        self.reward_tests: RewardTests = reward_tests
        self.profile = profile
        # Identical code for one problem in one batch runs once and every copy gets its verdict:
        # the same verdicts for deterministic programs, far fewer runs once a policy sharpens.
        # Off by default: a program whose verdict varies (randomness, timing) is run once only.
        self.dedupe = dedupe

    def _with_tests(self, reward_tests: RewardTests) -> Grader:
        return Grader(
            self.sandbox,
            self.reward_kind,
            self.early_stop,
            self.per_test_timeout,
            reward_tests,
            self.profile,
            self.dedupe,
        )

    def public_view(self) -> Grader:
        """The same grader on public tests only: what a search may see during evaluation."""
        return self._with_tests("public")

    def full_view(self) -> Grader:
        """The same grader on public + private tests: what metric verdicts use."""
        return self if self.reward_tests == "all" else self._with_tests("all")

    def grade(self, items: Sequence[tuple[Problem, str]], with_public: bool = True) -> list[Grade]:
        """Grade (problem, completion) pairs in one sandbox batch."""
        codes = [extract_code(completion, profile_of(p, self.profile)) for p, completion in items]
        return self.grade_code(
            [(p, c) for (p, _), c in zip(items, codes, strict=True)], with_public
        )

    def _split(
        self, problem: Problem, with_public: bool
    ) -> tuple[tuple[TestCase, ...], tuple[TestCase, ...], bool]:
        """(public tests to run, private tests to run, whether the public ones count)."""
        if not with_public:  # explicit request for the private set alone (benchmarks, HumanEval)
            return (), problem.all_tests, False
        if self.reward_tests == "public":
            return problem.public_tests, (), True
        if problem.test_kind is TestKind.HUMANEVAL:
            return problem.public_tests, problem.all_tests, False
        return problem.public_tests, hidden_tests(problem), True

    def _job_timeout(self, profile: str, n_tests: int) -> float | None:
        """LiveCodeBench has no whole-answer cap: its bound grows with the number of tests."""
        prof = get_profile(profile)
        if prof.job_time_cap:
            return None
        defaults: dict[str, Any] = getattr(self.sandbox, "defaults", {}) or {}
        per_test = self.per_test_timeout or float(defaults.get("per_test_timeout", 6.0))
        configured = float(defaults.get("job_timeout", 60.0))
        return prof.job_wall_bound(per_test, n_tests, configured)

    def _run_with_retry(self, jobs: list[Job]) -> list[JobResult]:
        """Run the batch; jobs whose result says nothing about the answer (a test starved by
        machine load, `overloaded`, or an infrastructure error such as a killed worker) run once
        more, so that our faults do not turn into a zero reward. What is still such a result
        after that is marked on its grade (`Grade.infra_error`), never graded wrong."""
        results = self.sandbox.run_batch(jobs) if jobs else []
        starved = [i for i, r in enumerate(results) if r.infra_error]
        if starved:
            again = self.sandbox.run_batch([jobs[i] for i in starved])
            for index, result in zip(starved, again, strict=True):
                results[index] = result
            still = sum(r.infra_error for r in again)
            if still:
                log.warning(
                    "%d of %d answers still had an infrastructure error (a sandbox worker lost, "
                    "or a test starved of CPU) after a re-run: they are left out of the rewards "
                    "and counted as infra_errors; check the sandbox (fewer workers?)",
                    still,
                    len(jobs),
                )
        return results

    def grade_code(
        self, items: Sequence[tuple[Problem, str | None]], with_public: bool = True
    ) -> list[Grade]:
        """Grade already-extracted code (None means the answer had no code).

        `with_public=False` runs the private tests alone (falling back to the public ones for a
        problem without private tests) and rewards on them.
        """
        jobs: list[Job] = []
        runs: dict[tuple[int, str], int] = {}  # (problem, code) -> its job (dedupe)
        job_of: dict[int, int] = {}  # item -> job
        for index, (problem, code) in enumerate(items):
            if code is None:
                continue
            if self.dedupe and (id(problem), code) in runs:
                job_of[index] = runs[(id(problem), code)]
                continue
            runs[(id(problem), code)] = job_of[index] = len(jobs)
            public, private, _ = self._split(problem, with_public)
            tests = list(public) + list(private)
            profile = profile_of(problem, self.profile)
            jobs.append(
                Job(
                    code=code,
                    kind=problem.test_kind.value,
                    tests=[{"input": t.input, "output": t.output} for t in tests],
                    fn_name=problem.fn_name,
                    per_test_timeout=self.per_test_timeout,
                    job_timeout=self._job_timeout(profile, len(tests)),
                    early_stop=self.early_stop,
                    profile=profile,
                )
            )
        results = self._run_with_retry(jobs)
        grades = [Grade(code=None, passed=False) for _ in items]
        for slot, job in job_of.items():
            problem, code = items[slot]
            result = results[job]
            public, private, public_counts = self._split(problem, with_public)
            public_part = result.tests[: len(public)]
            private_part = result.tests[len(public) :]
            counted = JobResult((public_part if public_counts else []) + private_part)
            grades[slot] = Grade(
                code=code,
                public=_feedback(public, public_part),
                private=_feedback(private, private_part),
                reward=0.0 if result.infra_error else reward_from(counted, self.reward_kind),
                passed=False if result.infra_error else counted.all_passed,
                infra_error=result.infra_error,
            )
        return grades
