"""One job's way through an executor, as named transitions on its verdict rows.

The worker asks `next_request` what to send the executor, hands each reply to `on_reply` (or
calls `executor_lost`), and stops once `done`; `results` are then the job's rows. A reply is read
as one of the transitions below, so tests can drive a job through every path without processes:

- `records_arrived`: the child reported tests; each is judged.
- `failed_halfway`: a humaneval assert failed in a progress frame and the child was stopped there.
- `overloaded`: the wall-clock net tripped on a test starved of CPU: it runs again in a fresh child
  (`overload_retries` times).
- `wrote_junk`: the child wrote something into its result channel that is not the next record.
- `stopped`: the child died, hung or hit the job's deadline before reporting the next test.
- `deadline_passed`, `compile_failed`, `executor_lost`: the rest of the job gets one verdict.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

from mars2.sandbox.protocol import KILL_MARGIN, ResultRow, WorkerConfig, wall_limit
from mars2.sandbox.runner import harness
from mars2.sandbox.verdict import judge
from mars2.sandbox.verdict.compare import clip, get_profile


class JobLoop:
    """The state of one job between its requests to the executor."""

    def __init__(
        self,
        job: dict[str, Any],
        config: WorkerConfig,
        checks: Sequence[judge.RewrittenCheck | None],
        now: float,
    ) -> None:
        self.tests: list[dict[str, str]] = list(job["tests"])
        self.count = len(self.tests)
        self.kind = str(job["kind"])
        self.profile = get_profile(str(job.get("profile") or "lenient")).name
        self.early_stop = bool(job.get("early_stop"))
        self.cpu_limit = float(job.get("per_test_timeout") or config.per_test_timeout)
        self.wall_limit = wall_limit(self.cpu_limit, config.wall_factor)
        configured = float(job.get("job_timeout") or config.job_timeout)
        bound = get_profile(self.profile).job_wall_bound(self.cpu_limit, self.count, configured)
        self.deadline = now + bound
        self.checks = list(checks)
        self.rows: list[ResultRow | None] = [None] * self.count
        self.retries = int(config.overload_retries)
        self.start = 0  # the first test without a verdict
        self.segments = 0  # children started
        self.done = self.count == 0
        self.watch: judge.Watch | None = None

    # -- what to send ---------------------------------------------------------------------------

    def next_request(self, now: float) -> dict[str, Any] | None:
        """The next request for the executor (from test `start` on), or None once done."""
        if not self.done and self.start >= self.count:
            self.done = True
        if self.done:
            return None
        remaining = self.deadline - now
        if remaining <= 0:
            self.deadline_passed(harness.TIMEOUT)
            return None
        self.watch = judge.Watch(
            self.start, self.tests, self.kind, self.profile, self.cpu_limit, self.checks,
            self.early_stop,
        )  # fmt: skip
        self.segments += 1
        return {
            "start": self.start, "cpu_limit": self.cpu_limit, "wall_limit": self.wall_limit,
            "remaining": remaining,
        }  # fmt: skip

    @staticmethod
    def reply_timeout(request: dict[str, Any]) -> float:
        """How long the worker waits for the reply to `request` before it gives the executor up."""
        return float(request["remaining"]) + KILL_MARGIN + 1.0

    # -- what came back -------------------------------------------------------------------------

    def on_reply(self, header: dict[str, Any], blob: bytes) -> None:
        """Read the executor's reply to the last request as the transitions it stands for."""
        if "compile_error" in header:
            self.compile_failed(clip(str(header["compile_error"]), harness.TEXT_CAP))
            return
        records, junk, _ = judge.parse_records(judge.strip_progress(blob), self.start, self.count)
        self.records_arrived(records)
        halfway = self.watch.failed_row if self.watch is not None else None
        if halfway is not None and halfway.index == self.start:
            self.failed_halfway(halfway)
            return
        tripped = bool(records) and records[-1]["status"] == harness.WALL
        last = self.rows[self.start - 1] if records else None
        if tripped and last is not None and last.verdict == harness.OVERLOADED and self.retries:
            self.overloaded()
            return
        if self.early_stop and self._any_failed():
            self.done = True
            return
        if tripped:
            return  # the child stopped after its wall-clock net; go on from the next test
        if self.start >= self.count:
            self.done = True
            return
        if junk:
            self.wrote_junk()
            return
        self.stopped(header, records)

    def records_arrived(self, records: Sequence[dict[str, Any]]) -> None:
        """Judge the tests the child reported, in order from `start`."""
        for record in records:
            index = record["index"]
            check = self.checks[index] if self.checks else None
            self.rows[index] = judge.judge_record(
                record, self.tests[index]["output"], self.kind, self.profile, self.cpu_limit, check
            )
        self.start += len(records)

    def failed_halfway(self, row: ResultRow) -> None:
        """An assert of test `start` failed: the check ends there, whatever the child did next;
        the rest run in a fresh child (or are skipped under early stop)."""
        self.rows[self.start] = row
        self.start += 1
        if self.early_stop:
            self.done = True

    def overloaded(self) -> None:
        """The last reported test was starved of CPU: run it again in a fresh child."""
        self.retries -= 1
        self.start -= 1

    def wrote_junk(self) -> None:
        """The child wrote into its result channel: its current test fails."""
        self._set(self.start, harness.RUNTIME_ERROR, "wrote to the sandbox's result channel")

    def stopped(self, header: dict[str, Any], records: Sequence[dict[str, Any]]) -> None:
        """The child ended (died, hung, ran into the deadline) without reporting test `start`."""
        row = self._stopped_row(header, records)
        outcome = header.get("outcome")
        if row.verdict == harness.OVERLOADED and self.retries > 0 and outcome == "hung":
            self.retries -= 1
            return  # the same test again, in a fresh child
        self.rows[self.start] = row
        self.start += 1
        if outcome == "deadline":
            self.deadline_passed(row.verdict)

    def deadline_passed(self, verdict: str) -> None:
        """The job's own time is up: every test left gets `verdict`."""
        self._fill(verdict, "job time limit exceeded")

    def compile_failed(self, error: str) -> None:
        self._fill(harness.COMPILE_ERROR, error)

    def executor_lost(self) -> None:
        """The executor stopped answering (and was killed): nothing more is known."""
        self._fill(harness.TIMEOUT, "the sandbox stopped answering")

    # -- the verdicts ---------------------------------------------------------------------------

    def results(self) -> list[ResultRow | None]:
        """The job's rows; under early stop every test after the first failure is skipped."""
        rows = list(self.rows)
        if self.early_stop:
            failed = next(
                (i for i, r in enumerate(rows) if r is not None and r.verdict != harness.PASSED),
                None,
            )
            if failed is not None:
                for i in range(failed + 1, self.count):
                    rows[i] = ResultRow(i, harness.SKIPPED)
        return rows

    def _any_failed(self) -> bool:
        return any(r is not None and r.verdict != harness.PASSED for r in self.rows)

    def _set(self, index: int, verdict: str, error: str) -> None:
        self.rows[index] = ResultRow(index, verdict, error)
        self.start = index + 1

    def _fill(self, verdict: str, error: str) -> None:
        for i in range(self.start, self.count):
            if self.rows[i] is None:
                self.rows[i] = ResultRow(i, verdict, error)
        self.done = True

    def _stopped_row(self, header: dict[str, Any], records: Sequence[dict[str, Any]]) -> ResultRow:
        """The verdict of the test the child never reported."""
        index = self.start
        if header.get("outcome") in ("hung", "deadline"):
            before = float(records[-1].get("cpu_total", 0.0)) if records else 0.0
            used = max(0.0, float(header["cpu"]) - before)
            verdict, error = judge.wall_trip_verdict(
                used, float(header["elapsed"]), None, self.cpu_limit
            )
            if header["outcome"] == "deadline" and verdict == harness.TIMEOUT:
                error = "job time limit exceeded"
            return ResultRow(index, verdict, error)
        status = header.get("status")
        if status is None:
            return ResultRow(index, harness.RUNTIME_ERROR, "the process vanished")
        return ResultRow(index, *_exit_verdict(int(status)))


def _exit_verdict(status: int) -> tuple[str, str]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:  # RLIMIT_CPU ran out
            return harness.TIMEOUT, "CPU time limit exceeded"
        return harness.RUNTIME_ERROR, f"killed by {signal.Signals(sig).name}"
    return harness.RUNTIME_ERROR, f"process exited with code {os.WEXITSTATUS(status)}"
