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
import signal
import sys
import time
from types import CodeType
from typing import Any

from mars2.sandbox import harness
from mars2.sandbox.isolation import (
    IsolationReport,
    Reaper,
    UidDropper,
    apply_limits,
    count_tasks_of,
    isolate_worker,
)
from mars2.sandbox.scratch import make_private_dir, remove_tree

# Preload what solutions commonly import, so a child forks with it already in memory. Each
# module held costs every fork a little, so rarely used ones (statistics, datetime) are left out.
_PRELOAD = (
    "collections", "heapq", "itertools", "functools", "math", "bisect", "re", "string", "random",
    "operator", "copy", "typing",
)  # fmt: skip


# Longer code is compiled in the child, under its limits: the compiler's time and memory grow
# with the source, and the worker has no limits of its own.
_WORKER_COMPILE_LIMIT = 64 << 10
# Without a dedicated uid the fork limit must leave room for the user's other tasks; counting
# them scans /proc, so the count is refreshed at most this often (seconds).
_TASK_COUNT_TTL = 1.0
_CHECK_CACHE_SIZE = 1024  # compiled humaneval check sources kept per worker
_MAX_RESULT_LINE = 1 << 20  # harness lines are clipped far below this


class Worker:
    """Runs jobs one at a time under the limits in `config`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.report = IsolationReport()
        self.scratch_root = make_private_dir(config["scratch_dir"], "mars2-sandbox-")
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
        # humaneval check sources are the dataset's (trusted) code and come back for every answer
        # to the same problem: compiled once here instead of in every child.
        self._check_code: dict[str, CodeType] = {}
        self._tasks, self._tasks_counted_at = 0, -_TASK_COUNT_TTL - 1.0
        self.devnull = os.open(os.devnull, os.O_RDWR)
        # Objects that exist now are never collected in children, so the collector does not
        # write to (and copy-on-write fault) the pages they share with this process.
        gc.freeze()

    def close(self) -> None:
        if self.reaper is not None:
            self.reaper.close()
        remove_tree(self.scratch_root)

    def _new_workdir(self) -> str:
        workdir = make_private_dir(self.scratch_root, "job-")
        if self.uid is not None:
            os.chown(workdir, self.uid, self.uid)
        return workdir

    def _reset_workdir(self) -> None:
        """Empty the job directory for the next job (cheaper than a new one each time)."""
        try:
            if os.listdir(self.workdir):  # most jobs leave nothing: skip the walk
                remove_tree(self.workdir, keep_top=True)
            os.chmod(self.workdir, 0o700)
            if not os.listdir(self.workdir):
                return
        except OSError:
            pass
        remove_tree(self.workdir)  # what could not be emptied is left for close()
        self.workdir = self._new_workdir()

    def _compiled_checks(self, job: dict[str, Any]) -> list[CodeType | None] | None:
        if job["kind"] != "humaneval":
            return None
        compiled: list[CodeType | None] = []
        for test in job["tests"]:
            source = test["input"]
            code = self._check_code.get(source)
            if code is None:
                try:
                    code = compile(source, "<string>", "exec", dont_inherit=True)
                except (SyntaxError, ValueError, MemoryError, RecursionError):
                    compiled.append(None)  # the child compiles it again and reports the error
                    continue
                if len(self._check_code) >= _CHECK_CACHE_SIZE:
                    self._check_code.clear()
                self._check_code[source] = code
            compiled.append(code)
        return compiled

    # -- one job ------------------------------------------------------------------------------

    def run_job(self, job: dict[str, Any]) -> dict[str, Any]:
        tests = job["tests"]
        results: list[dict[str, Any] | None] = [None] * len(tests)
        per_test = float(job.get("per_test_timeout", self.config["per_test_timeout"]))
        deadline = time.monotonic() + float(job.get("job_timeout", self.config["job_timeout"]))
        workdir = self.workdir
        solution = None
        if len(job["code"]) <= _WORKER_COMPILE_LIMIT:
            # Compiled here, not in the child: a compiler run in a fresh child costs it some
            # hundred page faults, and code that does not compile needs no child at all.
            try:
                solution = harness.compile_solution(job["code"])
            except (SyntaxError, ValueError) as err:
                rows = harness.compile_error_results(err, 0, len(tests))
                return {"id": job.get("id"), "results": rows, "children": 0}
            except (MemoryError, RecursionError):
                pass  # judged by the child, under its memory and recursion limits
        checks = self._compiled_checks(job)
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
                next_index = self._run_child(
                    job, solution, checks, next_index, per_test, deadline, workdir, results
                )
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
        solution: CodeType | None,
        checks: list[CodeType | None] | None,
        start: int,
        per_test: float,
        deadline: float,
        workdir: str,
        results: list[dict[str, Any] | None],
    ) -> int:
        """Fork a child for tests[start:]; return the index of the first test not yet judged."""
        read_fd, write_fd = os.pipe()
        cpu_seconds = max(1, int(deadline - time.monotonic()) + 1)
        running_tasks = self._running_tasks()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.close(read_fd)
                self._enter_child(workdir, cpu_seconds, write_fd, running_tasks)

                def emit(result: dict[str, Any]) -> None:
                    _write_all(write_fd, (harness.encode_result(result) + "\n").encode())

                harness.run_tests(
                    job["code"], job["kind"], job["tests"], emit,
                    fn_name=job.get("fn_name"), start=start, per_test_timeout=per_test,
                    output_limit=int(job.get("output_limit", self.config["output_limit"])),
                    early_stop=bool(job.get("early_stop", False)), scratch=workdir,
                    solution=solution, test_code=checks,
                )  # fmt: skip
            except BaseException:
                pass
            os._exit(0)
        os.close(write_fd)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child already did it, or already exited
        # While the child lives, every page this process writes is copied for it: so only raw
        # bytes are collected here, and the lines are parsed once the child is gone.
        received = bytearray()
        reported = 0
        status: int | None = None
        count = len(job["tests"])
        try:
            while start + reported < count:
                wait = min(per_test + self.config["grace"], deadline - time.monotonic())
                if wait <= 0 or not select.select([read_fd], [], [], wait)[0]:
                    break  # hung, possibly beyond SIGALRM's reach (C code, blocked signals)
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:  # EOF: the child is gone
                    _, status = os.waitpid(pid, 0)
                    break
                received += chunk
                reported = received.count(b"\n")
                if len(received) - received.rfind(b"\n") > _MAX_RESULT_LINE:
                    received += b"\n"  # user code is flooding the channel: judged as garbage
                    break
        finally:
            os.close(read_fd)
            self._kill(pid, reap=status is None)
        return self._collect(received, start, count, status, results)

    @classmethod
    def _collect(
        cls,
        received: bytearray,
        start: int,
        count: int,
        status: int | None,
        results: list[dict[str, Any] | None],
    ) -> int:
        """Store the child's result lines; judge the test it stopped at; return the next index."""
        current = start
        for line in bytes(received).split(b"\n")[:-1]:
            if current >= count:
                break
            try:
                item = json.loads(line)
                valid = int(item["index"]) == current
            except (ValueError, KeyError, TypeError):
                valid = False
            if not valid:  # user code wrote into the channel
                results[current] = {
                    "index": current,
                    "verdict": harness.RUNTIME_ERROR,
                    "error": "wrote to the sandbox's result channel",
                }
                return current + 1
            results[current] = item
            current += 1
        if current >= count:
            return current
        if status is not None:
            results[current] = cls._crash_result(current, status)
        else:
            results[current] = {
                "index": current,
                "verdict": harness.TIMEOUT,
                "error": "time limit exceeded",
            }
        return current + 1

    def _running_tasks(self) -> int:
        """Tasks the child's uid already runs: 0 for a dedicated uid, else a recent count."""
        if self.uid is not None:
            return 0
        now = time.monotonic()
        if now - self._tasks_counted_at > _TASK_COUNT_TTL:
            self._tasks = count_tasks_of(os.getuid())
            self._tasks_counted_at = now
        return self._tasks

    def _enter_child(
        self, workdir: str, cpu_seconds: int, result_fd: int, running_tasks: int
    ) -> None:
        # Every page the child writes is a copy-on-write fault, the main cost of a job: so the
        # collector never walks the worker's objects, and the setup below stays at raw syscalls.
        gc.freeze()
        os.setpgid(0, 0)
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
            running_tasks=running_tasks,
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


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
