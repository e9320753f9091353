"""`E2BSandbox`: run jobs on E2B's remote sandboxes (``pip install 'mars2[e2b]'``, ``E2B_API_KEY``).

Each job writes our stdlib-only `harness` (with `compare` and `prelude`) and the job's inputs into
a pooled remote sandbox and runs ``python3 harness.py job.json``; raw records come back on stdout
and the verdicts are decided here, by `judge`: expected outputs never leave this machine (humaneval
checks are shipped with their literal expectations taken out). Sandboxes are reused across jobs
(each job in a fresh directory), at most `max_concurrency` at once, and replaced after errors.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import random
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars2.sandbox import base
from mars2.sandbox.base import Job, JobResult, Sandbox, Verdict, results_from_rows
from mars2.sandbox.protocol import ResultRow, wall_limit
from mars2.sandbox.runner import harness
from mars2.sandbox.verdict import compare, judge, prelude
from mars2.sandbox.verdict.compare import get_profile

log = logging.getLogger(__name__)
_MARKER = harness.MARKER
# Shipped next to each other, flat: the harness imports the other two by their bare names there.
_SOURCES = {
    f"{module.__name__.rsplit('.', 1)[1]}.py": Path(str(module.__file__)).read_text(
        encoding="utf-8"
    )
    for module in (harness, compare, prelude)
}


def parse_result_lines(stdout: str, count: int) -> list[dict[str, Any]]:
    """The harness's raw records out of a remote run's stdout, validated in test order.

    Other output is ignored; the first marked line that is not the next test's record ends the
    parse (the answer wrote into the channel, and only hurts itself).
    """
    lines = [line[len(_MARKER) :] for line in stdout.splitlines() if line.startswith(_MARKER)]
    blob = "".join(line + "\n" for line in lines).encode("utf-8", "replace")
    records, _, _ = judge.parse_records(blob, 0, count)
    return records


def remote_job(
    job: Job, payload: dict[str, Any], wall_factor: float = 3.0
) -> tuple[dict[str, Any], list[Any]]:
    """The remote job file (inputs only) and the rewritten humaneval checks judged here."""
    inputs = judge.tests_inputs(payload["tests"])
    checks: list[judge.RewrittenCheck | None] = []
    if job.kind == "humaneval":
        checks = [judge.rewrite_check(source) for source in inputs]
        inputs = [c.source() if c is not None else s for c, s in zip(checks, inputs)]
    per_test = float(payload["per_test_timeout"])
    remote = {
        "code": payload["code"], "kind": payload["kind"], "inputs": inputs,
        "fn_name": payload["fn_name"], "per_test_timeout": per_test,
        "wall_limit": wall_limit(per_test, wall_factor), "output_limit": payload["output_limit"],
        "profile": payload["profile"], "early_stop": payload["early_stop"],
    }  # fmt: skip
    return remote, checks


def judge_remote(job: Job, payload: dict[str, Any], stdout: str, checks: list[Any]) -> JobResult:
    """Verdicts, decided here, from a remote run's stdout."""
    count = len(job.tests)
    rows: list[ResultRow | None] = [None] * count
    for record in parse_result_lines(stdout, count):
        index = record["index"]
        rows[index] = judge.judge_record(
            record,
            job.tests[index]["output"],
            job.kind,
            payload["profile"],
            float(payload["per_test_timeout"]),
            checks[index] if checks else None,
        )
    if payload.get("early_stop"):
        failed = next(
            (i for i, r in enumerate(rows) if r is None or r.verdict != harness.PASSED), None
        )
        if failed is not None and rows[failed] is not None:
            for i in range(failed + 1, count):
                rows[i] = ResultRow(i, harness.SKIPPED)
    return results_from_rows(rows, count, "remote run ended before this test")


class E2BSandbox(Sandbox):
    """Remote sandbox on E2B with a concurrency limit, retries with backoff and timeouts.

    Sandboxes are created without internet access unless `allow_network` (the setting the local
    sandbox shares). Creating many at once (a large first batch) is spread out: each create waits
    a random delay of up to `create_jitter` seconds per create already pending, and at most
    `max_parallel_creates` run at once, since E2B's gateway drops bursts of creates.
    """

    def __init__(
        self,
        api_key: str | None = None,
        max_concurrency: int = 16,
        retries: int = 3,
        per_test_timeout: float = base.PER_TEST_TIMEOUT,
        job_timeout: float = base.JOB_TIMEOUT,
        sandbox_timeout: int = 600,
        template: str | None = None,
        output_limit_mb: float = base.OUTPUT_LIMIT_MB,
        allow_network: bool = False,
        wall_factor: float = 3.0,
        create_jitter: float = 0.25,
        max_parallel_creates: int = 8,
        max_creates_per_second: float | None = None,
        backoff: float = 0.5,
        seed: int | None = None,
        sdk: Any = None,
    ) -> None:
        if max_creates_per_second is not None and max_creates_per_second <= 0:
            raise ValueError("max_creates_per_second must be > 0 (E2B Hobby: 1, Pro: 5) or None")
        if wall_factor < 1.0 or create_jitter < 0 or max_parallel_creates < 1:
            raise ValueError(
                "wall_factor must be >= 1, create_jitter >= 0 and max_parallel_creates >= 1"
            )
        self._api_key = api_key or os.environ.get("E2B_API_KEY")
        if not self._api_key:
            raise ValueError("E2BSandbox needs an API key: set E2B_API_KEY or pass api_key")
        if sdk is None:
            try:
                sdk = importlib.import_module("e2b_code_interpreter")
            except ImportError as err:
                raise ImportError(
                    "E2BSandbox needs the e2b extra: pip install 'mars2[e2b]'"
                ) from err
        self._sdk = sdk
        self.max_concurrency = max_concurrency
        self.retries = retries
        self.sandbox_timeout = sandbox_timeout
        self.template = template
        self.allow_network = allow_network
        self.wall_factor = wall_factor
        self.create_jitter = create_jitter
        self.max_parallel_creates = max_parallel_creates
        # E2B's plans cap creations per second (Hobby 1/s, Pro 5/s) and concurrent sandboxes
        # (max_concurrency: Hobby 20, Pro 100); a create waits for its slot instead of a 429.
        self.max_creates_per_second = max_creates_per_second
        self.backoff = backoff
        self.retried = 0  # failed attempts that were tried again (or given up): the step's count
        self._next_create = 0.0
        self._rate_lock: asyncio.Lock | None = None
        self._rng = random.Random(seed)
        self._pending_creates = 0
        self._create_gate: asyncio.Semaphore | None = None
        self.defaults = {
            "per_test_timeout": per_test_timeout,
            "job_timeout": job_timeout,
            "output_limit": int(output_limit_mb * (1 << 20)),
        }
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="e2b-loop")
        self._thread.start()
        self._idle: asyncio.Queue[Any] | None = None
        self._created = 0
        self._semaphore: asyncio.Semaphore | None = None

    # -- pool -------------------------------------------------------------------------------

    def create_options(self) -> dict[str, Any]:
        """The keyword arguments of each `AsyncSandbox.create` call."""
        options: dict[str, Any] = {
            "api_key": self._api_key,
            "timeout": self.sandbox_timeout,
            "allow_internet_access": self.allow_network,
        }
        if self.template:
            options["template"] = self.template
        return options

    async def _acquire(self) -> Any:
        assert self._idle is not None and self._create_gate is not None
        if not self._idle.empty():
            return self._idle.get_nowait()
        self._pending_creates += 1
        try:
            ahead = self._pending_creates - 1
            if ahead and self.create_jitter:
                await asyncio.sleep(self._rng.uniform(0.0, self.create_jitter * ahead))
            async with self._create_gate:
                await self._wait_for_create_slot()
                self._created += 1
                return await self._sdk.AsyncSandbox.create(**self.create_options())
        finally:
            self._pending_creates -= 1

    async def _wait_for_create_slot(self) -> None:
        """At most `max_creates_per_second` creations start per second."""
        if self.max_creates_per_second is None:
            return
        assert self._rate_lock is not None
        async with self._rate_lock:
            loop = asyncio.get_running_loop()
            wait = self._next_create - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._next_create = (
                max(loop.time(), self._next_create) + 1.0 / self.max_creates_per_second
            )

    @property
    def created(self) -> int:
        """Remote sandboxes created so far (a reused one counts once)."""
        return self._created

    async def _discard(self, remote: Any) -> None:
        try:
            await remote.kill()
        except Exception as err:
            log.debug("killing a broken E2B sandbox failed: %s", err)

    async def _run_job(self, job: Job) -> JobResult:
        assert self._semaphore is not None and self._idle is not None
        payload = job.payload(self.defaults)
        remote_job_file, checks = remote_job(job, payload, self.wall_factor)
        bound = get_profile(payload["profile"]).job_wall_bound(
            float(payload["per_test_timeout"]), len(job.tests), float(payload["job_timeout"])
        )
        last_error = ""
        async with self._semaphore:
            for attempt in range(self.retries):
                remote = None
                try:
                    remote = await self._acquire()
                    workdir = f"/tmp/mars2-{uuid.uuid4().hex}"
                    for name, source in _SOURCES.items():
                        await remote.files.write(f"{workdir}/{name}", source)
                    await remote.files.write(f"{workdir}/job.json", json.dumps(remote_job_file))
                    command = f"cd {workdir} && python3 harness.py job.json; rm -rf {workdir}"
                    stdout = await self._run_command(remote, command, bound + 5)
                    self._idle.put_nowait(remote)
                    return judge_remote(job, payload, stdout, checks)
                except Exception as err:
                    last_error = f"{type(err).__name__}: {err}"
                    log.warning(
                        "E2B job attempt %d/%d failed: %s", attempt + 1, self.retries, last_error
                    )
                    self.retried += 1
                    if remote is not None:
                        await self._discard(remote)
                    if attempt + 1 < self.retries:  # jittered exponential backoff
                        pause = min(8.0, self.backoff * 2**attempt)
                        await asyncio.sleep(self._rng.uniform(0.5, 1.0) * pause)
        return JobResult.failed(
            len(job.tests), Verdict.INFRA_ERROR, f"E2B unavailable: {last_error}"
        )

    @staticmethod
    async def _run_command(remote: Any, command: str, timeout: float) -> str:
        try:
            result = await remote.commands.run(command, timeout=timeout)
        except Exception as err:
            # The SDK raises on a non-zero exit; its stdout still holds the finished tests.
            stdout = getattr(err, "stdout", None)
            if stdout is None:
                raise
            return str(stdout)
        return str(result.stdout)

    async def _run_all(self, jobs: Sequence[Job]) -> list[JobResult]:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            self._create_gate = asyncio.Semaphore(self.max_parallel_creates)
            self._rate_lock = asyncio.Lock()
            self._idle = asyncio.Queue()
        return list(await asyncio.gather(*(self._run_job(job) for job in jobs)))

    # -- Sandbox ----------------------------------------------------------------------------

    def run_batch(self, jobs: Sequence[Job]) -> list[JobResult]:
        future = asyncio.run_coroutine_threadsafe(self._run_all(jobs), self._loop)
        return future.result()

    async def run(self, jobs: Sequence[Job]) -> list[JobResult]:
        future = asyncio.run_coroutine_threadsafe(self._run_all(jobs), self._loop)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def drain() -> None:
            while self._idle is not None and not self._idle.empty():
                await self._discard(self._idle.get_nowait())

        asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
