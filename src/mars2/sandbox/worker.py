"""A pre-started sandbox worker process: reads jobs as JSON lines, forks one child per job.

Started by `LocalSandbox` as ``python -m mars2.sandbox.worker CONFIG_JSON`` from a clean interpreter
(never forked from a training process holding GPU state). The child applies rlimits, runs every
test of its job in-process (see `harness`) and streams one result line per test back through a
pipe, so the worker keeps what finished when the child hangs or dies and restarts the rest.
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from mars2.sandbox import harness
from mars2.sandbox.isolation import (
    IsolationReport,
    Reaper,
    UidDropper,
    apply_limits,
    isolate_worker,
)

# Preload what solutions commonly import, so a child forks with it already in memory.
_PRELOAD = (
    "collections", "heapq", "itertools", "functools", "math", "bisect", "re", "string", "random",
    "decimal", "fractions", "statistics", "operator", "copy", "datetime", "array", "typing",
)  # fmt: skip


class Worker:
    """Runs jobs one at a time under the limits in `config`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.report = IsolationReport()
        self.scratch_root = tempfile.mkdtemp(prefix="mars2-sandbox-", dir=config.get("scratch_dir"))
        os.chmod(self.scratch_root, 0o711)
        isolate_worker(
            self.scratch_root, config["allow_network"], config["readonly_root"], self.report
        )
        uid = config.get("sandbox_uid")
        self.uid: int | None = uid if (uid is not None and os.geteuid() == 0) else None
        if uid is not None and self.uid is None:
            self.report.missing.append("dedicated uid (not root): fork limit shared with this user")
        self.report.sandbox_uid = self.uid
        self.reaper = Reaper(self.uid) if self.uid is not None else None
        self.dropper = UidDropper(self.uid) if self.uid is not None else None
        for name in _PRELOAD:
            __import__(name)
        self.workdir = self._new_workdir()
        self.devnull = os.open(os.devnull, os.O_RDWR)
        # Objects that exist now are never collected in children, so the collector does not
        # write to (and copy-on-write fault) the pages they share with this process.
        gc.freeze()

    def close(self) -> None:
        if self.reaper is not None:
            self.reaper.close()
        shutil.rmtree(self.scratch_root, ignore_errors=True)

    def _new_workdir(self) -> str:
        workdir = tempfile.mkdtemp(dir=self.scratch_root)
        if self.uid is not None:
            os.chown(workdir, self.uid, self.uid)
        return workdir

    def _reset_workdir(self) -> None:
        """Empty the job directory for the next job (cheaper than a new one each time)."""
        try:
            with os.scandir(self.workdir) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
            os.chmod(self.workdir, 0o700)
        except OSError:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = self._new_workdir()

    # -- one job ------------------------------------------------------------------------------

    def run_job(self, job: dict[str, Any]) -> dict[str, Any]:
        tests = job["tests"]
        results: list[dict[str, Any] | None] = [None] * len(tests)
        per_test = float(job.get("per_test_timeout", self.config["per_test_timeout"]))
        deadline = time.monotonic() + float(job.get("job_timeout", self.config["job_timeout"]))
        workdir = self.workdir
        next_index = 0
        restarts = 0
        try:
            while next_index < len(tests):
                if time.monotonic() >= deadline:
                    for i in range(next_index, len(tests)):
                        results[i] = {
                            "index": i,
                            "verdict": harness.TIMEOUT,
                            "error": "job time limit exceeded",
                        }
                    break
                next_index = self._run_child(job, next_index, per_test, deadline, workdir, results)
                restarts += 1
                if job.get("early_stop") and any(
                    r and r["verdict"] != harness.PASSED for r in results
                ):
                    for i in range(next_index, len(tests)):
                        results[i] = results[i] or {"index": i, "verdict": harness.SKIPPED}
                    break
        finally:
            self._reset_workdir()
        return {"id": job.get("id"), "results": results, "children": restarts}

    def _run_child(
        self,
        job: dict[str, Any],
        start: int,
        per_test: float,
        deadline: float,
        workdir: str,
        results: list[dict[str, Any] | None],
    ) -> int:
        """Fork a child for tests[start:]; return the index of the first test not yet judged."""
        read_fd, write_fd = os.pipe()
        cpu_seconds = max(1, int(deadline - time.monotonic()) + 1)
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.close(read_fd)
                self._enter_child(workdir, cpu_seconds, write_fd)
                sink = os.fdopen(write_fd, "w", buffering=1)

                def emit(result: dict[str, Any]) -> None:
                    sink.write(json.dumps(result) + "\n")
                    sink.flush()

                harness.run_tests(
                    job["code"], job["kind"], job["tests"], emit,
                    fn_name=job.get("fn_name"), start=start, per_test_timeout=per_test,
                    output_limit=int(job.get("output_limit", self.config["output_limit"])),
                    early_stop=bool(job.get("early_stop", False)), scratch=workdir,
                )  # fmt: skip
                sink.flush()
            except BaseException:
                pass
            os._exit(0)
        os.close(write_fd)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child already did it, or already exited
        current = start
        buffer = b""
        status_known = False
        try:
            while current < len(job["tests"]):
                wait = min(per_test + self.config["grace"], deadline - time.monotonic())
                if wait <= 0:
                    results[current] = {
                        "index": current,
                        "verdict": harness.TIMEOUT,
                        "error": "time limit exceeded",
                    }
                    return current + 1
                ready, _, _ = select.select([read_fd], [], [], wait)
                if not ready:  # hung beyond SIGALRM's reach (C code, blocked signals)
                    results[current] = {
                        "index": current,
                        "verdict": harness.TIMEOUT,
                        "error": "time limit exceeded",
                    }
                    return current + 1
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:  # EOF: the child is gone
                    _, status = os.waitpid(pid, 0)
                    status_known = True
                    if current < len(job["tests"]):
                        results[current] = self._crash_result(current, status)
                        return current + 1
                    return current
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    try:
                        item = json.loads(line)
                        index = int(item["index"])
                    except (ValueError, KeyError, TypeError):  # user code wrote into the channel
                        results[current] = {
                            "index": current,
                            "verdict": harness.RUNTIME_ERROR,
                            "error": "wrote to the sandbox's result channel",
                        }
                        return current + 1
                    results[index] = item
                    current = index + 1
            return current
        finally:
            os.close(read_fd)
            self._kill(pid, reap=not status_known)

    def _enter_child(self, workdir: str, cpu_seconds: int, result_fd: int) -> None:
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(workdir)
        for fd in (0, 1, 2):  # Python-level output is captured by the harness; the rest is dropped
            os.dup2(self.devnull, fd)
        # Nothing of the worker's may reach user code: its protocol pipe, the reaper's pipes.
        os.closerange(3, result_fd)
        os.closerange(result_fd + 1, 1 << 16)
        if self.dropper is not None:
            self.dropper.drop()
        apply_limits(
            memory_bytes=int(self.config["memory_mb"]) << 20,
            cpu_seconds=cpu_seconds,
            max_processes=int(self.config["max_processes"]),
            file_bytes=int(self.config["file_size_mb"]) << 20,
            dedicated_uid=self.uid is not None,
        )

    @staticmethod
    def _crash_result(index: int, status: int) -> dict[str, Any]:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            name = signal.Signals(sig).name
            if sig == signal.SIGXCPU:  # RLIMIT_CPU ran out
                return {
                    "index": index,
                    "verdict": harness.TIMEOUT,
                    "error": "CPU time limit exceeded",
                }
            return {"index": index, "verdict": harness.RUNTIME_ERROR, "error": f"killed by {name}"}
        return {
            "index": index,
            "verdict": harness.RUNTIME_ERROR,
            "error": f"process exited with code {os.WEXITSTATUS(status)}",
        }

    def _kill(self, pid: int, reap: bool) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if self.reaper is not None:
            self.reaper.reap()
        if reap:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def main() -> None:
    """Serve jobs from stdin until it closes; the first line written is the isolation report."""
    config = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool owns our lifetime, not the terminal
    worker = Worker(config)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    hello = {
        "ready": True,
        "isolation": worker.report.__dict__,
        "scratch_root": worker.scratch_root,
    }
    out.write(json.dumps(hello) + "\n")
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            job = json.loads(line)
            try:
                reply = worker.run_job(job)
            except Exception as err:
                reply = {"id": job.get("id"), "error": f"{type(err).__name__}: {err}"}
            out.write(json.dumps(reply) + "\n")
    finally:
        worker.close()


if __name__ == "__main__":
    main()
