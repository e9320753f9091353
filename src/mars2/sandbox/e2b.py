"""`E2BSandbox`: run jobs on E2B's remote sandboxes (``pip install 'mars2[e2b]'``, ``E2B_API_KEY``).

Each job writes our stdlib-only `harness` and its payload into a pooled remote sandbox and runs
``python3 harness.py job.json``; result lines come back on stdout. Sandboxes are reused across
jobs (each job in a fresh directory), at most `max_concurrency` at once, and replaced after errors.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars2.sandbox.base import Job, JobResult, Sandbox, Verdict, results_from_rows

log = logging.getLogger(__name__)
_MARKER = "@@MARS2@@"
_HARNESS_SOURCE = (Path(__file__).with_name("harness.py")).read_text(encoding="utf-8")


def parse_result_lines(stdout: str) -> list[dict[str, Any]]:
    """The harness's result rows out of a remote run's stdout (other output is ignored)."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith(_MARKER):
            rows.append(json.loads(line[len(_MARKER) :]))
    return rows


class E2BSandbox(Sandbox):
    """Remote sandbox on E2B with a concurrency limit, retries with backoff and timeouts."""

    def __init__(
        self,
        api_key: str | None = None,
        max_concurrency: int = 16,
        retries: int = 3,
        per_test_timeout: float = 6.0,
        job_timeout: float = 60.0,
        sandbox_timeout: int = 600,
        template: str | None = None,
        output_limit_mb: float = 1.0,
        sdk: Any = None,
    ) -> None:
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

    async def _acquire(self) -> Any:
        assert self._idle is not None
        if not self._idle.empty():
            return self._idle.get_nowait()
        kwargs: dict[str, Any] = {"api_key": self._api_key, "timeout": self.sandbox_timeout}
        if self.template:
            kwargs["template"] = self.template
        self._created += 1
        return await self._sdk.AsyncSandbox.create(**kwargs)

    async def _discard(self, remote: Any) -> None:
        try:
            await remote.kill()
        except Exception as err:
            log.debug("killing a broken E2B sandbox failed: %s", err)

    async def _run_job(self, job: Job) -> JobResult:
        assert self._semaphore is not None and self._idle is not None
        payload = job.payload(self.defaults)
        last_error = ""
        async with self._semaphore:
            for attempt in range(self.retries):
                remote = None
                try:
                    remote = await self._acquire()
                    workdir = f"/tmp/mars2-{uuid.uuid4().hex}"
                    await remote.files.write(f"{workdir}/harness.py", _HARNESS_SOURCE)
                    await remote.files.write(f"{workdir}/job.json", json.dumps(payload))
                    command = f"cd {workdir} && python3 harness.py job.json; rm -rf {workdir}"
                    stdout = await self._run_command(
                        remote, command, float(payload["job_timeout"]) + 5
                    )
                    self._idle.put_nowait(remote)
                    rows = parse_result_lines(stdout)
                    by_index: list[dict[str, Any] | None] = [None] * len(job.tests)
                    for row in rows:
                        by_index[int(row["index"])] = row
                    return results_from_rows(
                        by_index, len(job.tests), "remote run ended before this test"
                    )
                except Exception as err:
                    last_error = f"{type(err).__name__}: {err}"
                    log.warning(
                        "E2B job attempt %d/%d failed: %s", attempt + 1, self.retries, last_error
                    )
                    if remote is not None:
                        await self._discard(remote)
                    await asyncio.sleep(min(8.0, 0.5 * 2**attempt))
        return JobResult.failed(
            len(job.tests), Verdict.RUNTIME_ERROR, f"E2B unavailable: {last_error}"
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
