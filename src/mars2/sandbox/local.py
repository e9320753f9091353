"""`LocalSandbox`: the embedded default, a pool of pre-started worker processes on this machine."""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import shutil
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
from mars2.sandbox.compare import get_profile
from mars2.sandbox.uid_lease import DEFAULT_FIRST_UID, UidLease

log = logging.getLogger(__name__)
_SRC_DIR = str(Path(__file__).resolve().parents[2])
# The only variables of the trainer's environment a worker (and so a job) gets: what the
# interpreter needs to start and to decode text. Never tokens, keys or tracking credentials.
ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH")
# Seconds the pool waits beyond a job's own deadline for a worker to kill and reap it.
_POOL_MARGIN = 5.0


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


class _WorkerHandle:
    """One worker subprocess and the line protocol to it."""

    def __init__(self, config: dict[str, Any], wrapper: list[str]) -> None:
        env = worker_environment()
        command = [*wrapper, sys.executable, "-m", "mars2.sandbox.worker", json.dumps(config)]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._buffer = b""
        hello = self._read_line(timeout=60.0)
        self.isolation: dict[str, Any] = hello.get("isolation", {})
        self.scratch_root: str | None = hello.get("scratch_root")

    def _read_line(self, timeout: float) -> dict[str, Any]:
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
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(payload).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            raise WorkerCrashed(f"worker pipe closed: {err}") from err
        return self._read_line(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        # Set only where jobs could not get a private tmpfs: a mount point in the worker's own
        # namespace, which the worker cannot remove, so the empty directory is left in ours.
        if self.scratch_root:
            shutil.rmtree(self.scratch_root, ignore_errors=True)
            self.scratch_root = None


class LocalSandbox(Sandbox):
    """Runs jobs in child processes forked from pre-started workers, under per-job limits.

    Each job runs in one child that reports raw outputs; its worker, another process, decides the
    verdicts (see `worker` and `judge`). Per test a CPU-time limit with a wall-clock safety net
    (`wall_factor`), per job a wall-clock limit; RLIMIT_AS / CPU / NPROC (processes + threads) /
    FSIZE, capped stdout and stderr, an allow-listed environment, and no network where the OS
    allows. As root also: a pid namespace per worker (everything a job starts dies with it), a
    read-only filesystem, private capped /tmp and /dev/shm, an IPC namespace where no System V or
    POSIX queue object can be made, a leased uid without capabilities, no_new_privs and a seccomp
    filter. See README's security paragraph for what this does not
    guarantee. `wrapper="bwrap"` starts workers inside bubblewrap when it is installed.
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
        pid_namespace: bool = True,
        output_limit_mb: float = OUTPUT_LIMIT_MB,
        allow_network: bool = False,
        readonly_root: bool = True,
        dedicated_uids: bool = True,
        base_uid: int = DEFAULT_FIRST_UID,
        scratch_dir: str | None = None,
        wrapper: str = "none",
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
        self.defaults = {
            "per_test_timeout": per_test_timeout,
            "job_timeout": job_timeout,
            "output_limit": int(output_limit_mb * (1 << 20)),
        }
        scratch_dir = scratch_dir or tempfile.gettempdir()
        self._wrapper = self._wrapper_command(wrapper, scratch_dir)
        self._config_base: dict[str, Any] = {
            **self.defaults,
            "memory_mb": memory_mb,
            "max_processes": max_processes,
            "max_threads": max_threads,
            "file_size_mb": file_size_mb,
            "tmp_size_mb": tmp_size_mb,
            "wall_factor": wall_factor,
            "overload_retries": overload_retries,
            "pid_namespace": pid_namespace,
            "allow_network": allow_network,
            "readonly_root": readonly_root and wrapper == "none",
            "scratch_dir": scratch_dir,
            "grace": 1.0,
        }
        # Each worker's uid is leased machine-wide: another pool (a second run, a DDP rank) never
        # gets it, so no pool ever kills another pool's jobs.
        self._uid_lease = (
            UidLease(self.num_workers, first_uid=base_uid)
            if dedicated_uids and os.geteuid() == 0
            else None
        )
        self._workers: list[_WorkerHandle | None] = [None] * self.num_workers
        self._locks = [threading.Lock() for _ in range(self.num_workers)]
        self._warned = False
        for index in range(self.num_workers):
            self._start_worker(index)

    @staticmethod
    def _wrapper_command(wrapper: str, scratch_dir: str) -> list[str]:
        if wrapper == "none":
            return []
        if wrapper != "bwrap":
            raise ValueError(f"unknown sandbox wrapper {wrapper!r}: use 'none' or 'bwrap'")
        binary = shutil.which("bwrap")
        if binary is None:
            raise FileNotFoundError("wrapper='bwrap' but bubblewrap is not installed")
        return [binary, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--bind", scratch_dir, scratch_dir, "--unshare-net", "--unshare-pid", "--die-with-parent"]  # fmt: skip

    def _start_worker(self, index: int) -> _WorkerHandle:
        config = dict(self._config_base)
        config["sandbox_uid"] = self._uid_lease.uids[index] if self._uid_lease else None
        handle = _WorkerHandle(config, self._wrapper)
        missing = handle.isolation.get("missing") or []
        if missing and not self._warned:
            log.warning("sandbox isolation is partial on this machine: %s", "; ".join(missing))
            self._warned = True
        self._workers[index] = handle
        return handle

    @property
    def isolation(self) -> dict[str, Any]:
        """What the first worker managed to set up (network, read-only root, uid, what is missing)."""
        handle = self._workers[0]
        return dict(handle.isolation) if handle else {}

    def _run_on(self, index: int, job: Job) -> JobResult:
        payload = job.payload(self.defaults)
        bound = get_profile(payload["profile"]).job_wall_bound(
            float(payload["per_test_timeout"]), len(job.tests), float(payload["job_timeout"])
        )
        # One deadline for every attempt: a job that hangs a worker costs at most its own time
        # limit plus the margin, never that twice over.
        deadline = time.monotonic() + bound + _POOL_MARGIN
        for attempt in range(2):
            handle = self._workers[index] or self._start_worker(index)
            try:
                reply = handle.request(payload, max(0.0, deadline - time.monotonic()))
            except WorkerCrashed as err:
                log.warning("sandbox worker %d failed (%s); restarting it", index, err)
                handle.proc.kill()
                handle.close()
                self._workers[index] = None
                if attempt == 1 or deadline - time.monotonic() < bound:
                    return JobResult.failed(
                        len(job.tests), Verdict.RUNTIME_ERROR, f"sandbox worker crashed: {err}"
                    )
                continue
            if "error" in reply:
                return JobResult.failed(
                    len(job.tests), Verdict.RUNTIME_ERROR, f"sandbox error: {reply['error']}"
                )
            return results_from_rows(
                reply["results"], len(job.tests), "not reported by the sandbox"
            )
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
        for index, handle in enumerate(self._workers):
            if handle is not None:
                handle.close()
                self._workers[index] = None
        # Only once every worker (and its executor) is gone may another pool take these uids.
        if self._uid_lease is not None:
            self._uid_lease.release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
