"""The executor: the fork server that runs answers, one child per job, and never sees an expected
output.

Started by a worker (`mars2.sandbox.pool.worker`) as ``python -m mars2.sandbox.runner.executor``,
inside the worker's container when it has one (`mars2.sandbox.container`: then it is pid 1 of a
pid namespace that holds only jobs, in its own mount, IPC, UTS and network namespaces, with a
read-only root and private /tmp and /dev/shm, and under the seccomp filter bubblewrap loaded).
Its first message from the worker is its `WorkerConfig`; it then sets no_new_privs and the shared
limits on itself (and, without a container, loads the seccomp filter): every child inherits them.
It warms up and answers ready. For each job it receives the
inputs only (humaneval checks with their literal expectations lifted out), compiles the answer,
forks one child that drops to the sandbox uid (as root), sets its own limits and runs every test
in-process (see `harness`), streaming one raw record per test back through a pipe. The executor
enforces the wall-clock deadlines, kills and reaps everything the job started, empties its
scratch space and sends the raw bytes on (as they come once the child sends progress frames, and
it stops the child when the worker says its verdict is known). The worker judges.
"""

from __future__ import annotations

import builtins
import gc
import os
import select
import signal
import sys
import time
from types import CodeType
from typing import Any

from mars2.sandbox.container import seccomp
from mars2.sandbox.protocol import KILL_MARGIN, WorkerConfig, recv_message, send_message, write_all
from mars2.sandbox.runner import harness, limits
from mars2.sandbox.runner.scratch import make_private_dir, remove_tree
from mars2.sandbox.verdict.prelude import PRELOAD_MODULES

# Preload what solutions commonly import, so a child forks with it already in memory. Each
# module held costs every fork a little, so rarely used ones (statistics, datetime) are left out.
_PRELOAD = (
    "collections", "heapq", "itertools", "functools", "math", "bisect", "re", "string", "random",
    "operator", "copy", "typing",
)  # fmt: skip

# Longer code is compiled in the child, under its limits: the compiler's time and memory grow
# with the source, and the executor has no limits of its own.
_EXECUTOR_COMPILE_LIMIT = 64 << 10
# Without a dedicated uid or a container the task limit must leave room for the user's other
# tasks; counting them scans /proc, so the count is refreshed at most this often (seconds).
_TASK_COUNT_TTL = 1.0


class Executor:
    """Runs in its own process; see the module docstring."""

    def __init__(self, config: WorkerConfig) -> None:
        for name in _PRELOAD + tuple(m for mods in PRELOAD_MODULES.values() for m in mods):
            __import__(name)
        self.config = config
        uid = config.sandbox_uid
        self.uid: int | None = uid if (uid is not None and os.geteuid() == 0) else None
        # In a container the executor is pid 1 of a pid namespace holding only jobs: kill(-1)
        # reaches them all, and no job can signal it.
        self.is_init = os.getpid() == 1
        self.job_parent = config.job_parent or "/tmp"
        self.private_tmp = self.is_init and self.job_parent == "/tmp"
        # What the container's /tmp holds before any job (directories bound back into it): a job
        # that may write there (one sharing this process's uid) leaves nothing beside it.
        self._tmp_baseline = set(os.listdir("/tmp")) if self.private_tmp else set()
        self.workdir = self._new_workdir()
        self._checks: dict[str, CodeType] = {}
        self._job: dict[str, Any] = {}
        self._solution: CodeType | None = None
        self._tests_code: list[CodeType | None] | None = None
        self._tasks, self._tasks_counted_at = 0, -_TASK_COUNT_TTL - 1.0
        self._from_worker, self._to_worker = -1, -1
        # The builtins as they are before any answer ran: humaneval checks run with these.
        self._clean_builtins = dict(vars(builtins))
        # no_new_privs, the seccomp filter and the shared limits are set here once and inherited
        # by every child: set in each child, they cost it a third of a millisecond of page faults.
        limits.apply_inherited_limits(
            file_bytes=int(config.file_size_mb) << 20, max_tasks=self._fixed_task_limit()
        )
        limits.set_no_new_privs()
        if self.uid is None:
            # Jobs run under this process's own uid: without this they could ptrace it or
            # write its memory through /proc.
            limits.set_undumpable()
        self.seccomp_error: str | None = None
        self.unfiltered: list[str] = []
        if config.seccomp and config.bwrap:
            # bubblewrap loaded the filters before this process started (--add-seccomp-fd), so
            # it never holds libseccomp and its binding, and every fork of it is smaller.
            if seccomp.installed_filters() == 0:
                self.seccomp_error = "bubblewrap did not load the seccomp filter"
        elif config.seccomp:
            try:
                self.unfiltered = seccomp.install()
            except seccomp.SeccompUnavailable as err:
                self.seccomp_error = str(err)
        self._warm_up()

    def _fixed_task_limit(self) -> int | None:
        """RLIMIT_NPROC set once here, where it does not depend on what else the uid runs."""
        if self.uid is not None:
            # It does not bind root: set here, it binds each job once it drops to its own uid.
            return self.config.max_tasks
        if self.is_init and self.config.task_limit:
            # Counted per user namespace (Linux 5.14+): the container holds this process alone.
            return self.config.max_tasks + 1
        return None

    def hello(self) -> dict[str, Any]:
        """What the executor set up, for the worker's isolation report."""
        return {
            "ready": True,
            "pid_namespace": self.is_init,
            "seccomp": self.config.seccomp and self.seccomp_error is None,
            "seccomp_error": self.seccomp_error,
            "unfiltered": self.unfiltered,
            "sandbox_uid": self.uid,
        }

    def _new_workdir(self) -> str:
        workdir = make_private_dir(self.job_parent, "job-")
        if self.uid is not None:
            os.chown(workdir, self.uid, self.uid)
        # Set here once, inherited by every child: nothing of the trainer's environment remains.
        os.environ["HOME"] = workdir
        os.environ["TMPDIR"] = workdir
        os.chdir(workdir)
        return workdir

    def _warm_up(self) -> None:
        """Run the harness here a few times on trivial jobs before any child is forked.

        CPython specialises a function's bytecode in place while it runs: run for the first time
        in each child, the harness would write to its code objects there, and every page written
        in a child is a copy-on-write fault. Run here, the children inherit it specialised.
        """
        function = "def f(x):\n    return [x, str(x)]\n"
        check = f"def check(c):\n    {harness.REPORT_NAME}(0, c(1))\n"
        jobs = [
            (function, "call", ["1", "2"], "lenient"),
            (function, "humaneval", [check], "lenient"),
            ("print(int(input()) + 1)\n", "stdin", ["1", "2"], "lenient"),
            ("print(int(input()) + 1)\n", "stdin", ["1", "2"], "lcb"),
        ]
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGPROF, signal.SIGALRM)}
        # The harness raises these for its profile; the executor keeps its own (it compiles).
        recursion_limit = sys.getrecursionlimit()
        digits = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else None
        try:
            for _ in range(10):  # past the interpreter's warm-up count
                for code, kind, inputs, profile in jobs:
                    harness.run_tests(
                        code, kind, inputs, lambda result: None, fn_name="f", cpu_limit=60.0,
                        wall_limit=60.0, profile=profile, clean_builtins=self._clean_builtins,
                        fresh=True,
                    )  # fmt: skip
        except Exception:
            pass  # only a missed speed-up
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            sys.setrecursionlimit(recursion_limit)
            if digits is not None:
                sys.set_int_max_str_digits(digits)

    def serve(self, rfd: int, wfd: int) -> None:
        self._from_worker, self._to_worker = rfd, wfd
        while True:
            message = recv_message(rfd)
            if message is None:
                return  # the worker is gone; as init, our exit takes every job with us
            header, _ = message
            if header.get("stop"):
                continue  # meant for a child that had already finished
            reply, blob = self._run(header)
            send_message(wfd, reply, blob)

    def _load(self, job: dict[str, Any]) -> str | None:
        """Take a new job; the compile error message if its code does not compile."""
        if job.get("reset_checks"):
            self._checks.clear()
        for key, source in job.get("checks") or ():
            try:
                self._checks[key] = compile(source, "<check>", "exec", dont_inherit=True)
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                pass  # the child reports it
        self._job = job
        self._tests_code = None
        if job["kind"] == "humaneval":
            self._tests_code = [self._checks.get(k) if k else None for k in job["check_keys"]]
        self._solution = None
        if len(job["code"]) <= _EXECUTOR_COMPILE_LIMIT:
            # Compiled here, not in the child: a compiler run in a fresh child costs it some
            # hundred page faults, and code that does not compile needs no child at all.
            try:
                self._solution = harness.compile_solution(job["code"])
            except (SyntaxError, ValueError) as err:
                return f"{type(err).__name__}: {err}"
            except (MemoryError, RecursionError):
                pass  # judged by the child, under its memory and recursion limits
        return None

    def _run(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        if "job" in header:
            error = self._load(header["job"])
            if error is not None:
                return {"compile_error": error}, b""
        try:
            return self._run_child(
                int(header["start"]),
                float(header["cpu_limit"]),
                float(header["wall_limit"]),
                time.monotonic() + float(header["remaining"]),
            )
        finally:
            self._clean()

    def _run_child(
        self, start: int, cpu_limit: float, wall_limit: float, deadline: float
    ) -> tuple[dict[str, Any], bytes]:
        job = self._job
        read_fd, write_fd = os.pipe()
        cpu_seconds = max(1, int(deadline - time.monotonic()) + 1)
        task_limit = self._child_task_limit()
        began = time.monotonic()
        # What this job made stays out of the children's collections; frozen here, where the
        # pages are still writable without a copy.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the answer's process
            try:
                os.close(read_fd)
                self._enter_child(cpu_seconds, write_fd, task_limit)

                def emit(result: dict[str, Any]) -> None:
                    write_all(write_fd, (harness.encode_result(result) + "\n").encode())

                def send_progress(frame: bytes) -> None:
                    try:
                        os.write(write_fd, frame)
                    except OSError:
                        pass  # progress only lets the judge stop a failing test sooner

                harness.run_tests(
                    job["code"], job["kind"], job["inputs"], emit,
                    fn_name=job.get("fn_name"), start=start, cpu_limit=cpu_limit,
                    wall_limit=wall_limit, output_limit=int(job["output_limit"]),
                    profile=job["profile"], scratch=self.workdir, solution=self._solution,
                    test_code=self._tests_code, clean_builtins=self._clean_builtins,
                    fresh=True, stop_on_error=bool(job.get("early_stop")),
                    send_progress=send_progress,
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
        # bytes are collected here, and the lines are parsed by the worker.
        received = bytearray()
        count = len(job["inputs"])
        max_line = 8 * int(job["output_limit"]) + (64 << 10)
        outcome = "eof"
        last_line_at = began
        # Once the child sends a progress frame (it has run a while), every byte it sends is
        # passed on to the worker at once, and the worker may answer "stop": it has the verdict.
        watched, streaming = [read_fd], False
        try:
            while True:
                now = time.monotonic()
                # The child enforces both limits itself; this net catches what blocks its signals.
                backstop = wall_limit * (harness.WALL_EXTENSIONS + 1) + self.config.grace
                wait = min(last_line_at + backstop, deadline) - now
                ready = select.select(watched, [], [], wait)[0] if wait > 0 else []
                if not ready:
                    outcome = "deadline" if time.monotonic() >= deadline else "hung"
                    break
                if self._from_worker in ready:
                    message = recv_message(self._from_worker, time.monotonic() + 1.0)
                    if message is None or message[0].get("stop"):
                        outcome = "stopped"
                        break
                if read_fd not in ready:
                    continue
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break  # EOF: the child exited, crashed or closed the channel
                if streaming or harness.PROGRESS_END in chunk:
                    send_message(
                        self._to_worker,
                        {"progress": True},
                        chunk if streaming else bytes(received + chunk),
                    )
                    watched, streaming = [read_fd, self._from_worker], True
                if b"\n" in chunk:
                    last_line_at = time.monotonic()
                received += chunk
                if received.count(b"\n") >= count - start:
                    break
                if len(received) - received.rfind(b"\n") > max_line:
                    received += b"\n"  # user code is flooding the channel: judged as junk
                    break
        finally:
            os.close(read_fd)
        elapsed = time.monotonic() - last_line_at
        # Kill first, then wait: a child that closed its channel and blocked its signals is not
        # waited for. Killing an exiting process does not change how it exited.
        status, cpu = self._kill_and_reap(pid)
        reply = {"outcome": outcome, "status": status, "cpu": cpu, "elapsed": elapsed}
        return reply, bytes(received)

    def _kill_and_reap(self, pid: int) -> tuple[int | None, float]:
        try:
            if self.is_init:
                os.kill(-1, signal.SIGKILL)  # every process of the job, wherever it moved
            else:
                os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        status, cpu = None, 0.0
        try:
            _, status, usage = os.wait4(pid, 0)
            cpu = usage.ru_utime + usage.ru_stime
        except ChildProcessError:
            pass
        deadline = time.monotonic() + KILL_MARGIN
        if self.is_init:
            # Orphans of the job were re-parented to us: reap them, bounded in time.
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        time.sleep(0.0005)
                except ChildProcessError:
                    break
        elif self.uid is not None and os.geteuid() == 0:
            limits.kill_uid(self.uid, deadline)
        return status, cpu

    def _clean(self) -> None:
        """Empty the job directory and the private /tmp, /dev/shm for the next job."""
        try:
            if os.listdir(self.workdir):  # most jobs leave nothing: skip the walk
                remove_tree(self.workdir, keep_top=True)
            os.chmod(self.workdir, 0o700)
            if self.private_tmp:
                if os.listdir("/dev/shm"):
                    remove_tree("/dev/shm", keep_top=True)
                self._clean_tmp()
            if not os.listdir(self.workdir):
                return
        except OSError:
            pass
        remove_tree(self.workdir)  # what could not be emptied is left for the worker's close
        self.workdir = self._new_workdir()

    def _clean_tmp(self) -> None:
        """Remove what a job left in the container's /tmp beside its own directory."""
        left = set(os.listdir("/tmp")) - self._tmp_baseline - {os.path.basename(self.workdir)}
        for name in left:
            path = os.path.join("/tmp", name)
            try:
                os.unlink(path)
            except IsADirectoryError:
                remove_tree(path)
            except OSError:
                pass

    def _child_task_limit(self) -> int | None:
        """RLIMIT_NPROC for the next child where the executor did not set it once: the job's own
        tasks plus what its uid already runs (a recent count; this process is not dumpable, so
        /proc shows it as root's and it is added by hand)."""
        if self._fixed_task_limit() is not None or self.is_init:
            return None  # set once, or (a container on an old kernel) not enforceable
        now = time.monotonic()
        if now - self._tasks_counted_at > _TASK_COUNT_TTL:
            self._tasks = limits.count_tasks_of(os.getuid()) + 1
            self._tasks_counted_at = now
        return self.config.max_tasks + self._tasks

    def _enter_child(self, cpu_seconds: int, result_fd: int, task_limit: int | None) -> None:
        # Every page the child writes is a copy-on-write fault, the main cost of a job: the
        # executor froze its objects before forking (the collector never walks them), and the
        # setup below stays at raw syscalls.
        # The working directory, fds 0-2 (/dev/null), no_new_privs, the seccomp filter, the
        # file-size and (where fixed) task limits are the executor's own, inherited.
        os.setpgid(0, 0)
        # Nothing of the executor's may reach user code: only the result pipe stays open.
        os.closerange(3, result_fd)
        os.closerange(result_fd + 1, 1 << 16)
        if self.uid is not None:
            limits.drop_to(self.uid)
        limits.apply_limits(
            memory_bytes=int(self.config.memory_mb) << 20,
            cpu_seconds=cpu_seconds,
            max_tasks=task_limit,
        )


def main() -> None:
    """Serve the worker on fds 0 and 1 until it closes them; the first message is the config."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker owns our lifetime
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    # The protocol pipes are the worker's alone; jobs inherit /dev/null on these three.
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    first = recv_message(rfd)
    if first is None:
        return
    config = WorkerConfig.from_json(first[0]["config"])
    if not config.bwrap:
        limits.die_with_parent()  # in a container, bubblewrap's --die-with-parent does this
    try:
        executor = Executor(config)
    except Exception as err:
        send_message(wfd, {"ready": False, "error": f"{type(err).__name__}: {err}"})
        return
    send_message(wfd, executor.hello())
    executor.serve(rfd, wfd)


if __name__ == "__main__":
    main()
