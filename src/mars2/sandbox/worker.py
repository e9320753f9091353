"""A pre-started sandbox worker: the judge of its jobs, with an executor that forks the answers.

Started by `LocalSandbox` as ``python -m mars2.sandbox.worker CONFIG_JSON`` from a clean interpreter
(never forked from a training process holding GPU state), with an allow-listed environment. It
splits in two at start, before it has read any job:

- the **executor** (forked first; as root, init of a pid namespace that holds only jobs; under
  no_new_privs and the seccomp filter, which its children inherit) receives a job's inputs, never
  its expected outputs, and forks one child per job under the sandbox uid, rlimits and no
  capabilities. The child runs the answer on every
  test (see `harness`) and streams one raw record per test back through a pipe; the executor
  enforces the wall-clock deadlines, kills and reaps everything the job started, empties its
  scratch space and sends the raw bytes on (as they come, once the child sends progress frames,
  and it stops the child when the worker says its verdict is known);
- the **worker** (this process) keeps the expected outputs, validates the records and decides
  the verdicts (`judge`), restarting the executor's child from the first test not yet judged when
  one dies or hangs. No answer can reach it: it runs as root in another process, outside the
  jobs' pid namespace.
"""

from __future__ import annotations

import builtins
import gc
import json
import os
import select
import signal
import struct
import sys
import time
from collections.abc import Callable
from types import CodeType
from typing import TYPE_CHECKING, Any

from mars2.sandbox import harness
from mars2.sandbox.compare import get_profile
from mars2.sandbox.isolation import (
    IsolationReport,
    UidDropper,
    apply_inherited_limits,
    apply_limits,
    count_tasks_of,
    isolate_worker,
    kill_uid,
    probe_seccomp,
)
from mars2.sandbox.prelude import PRELOAD_MODULES
from mars2.sandbox.scratch import make_private_dir, remove_tree

# Preload what solutions commonly import, so a child forks with it already in memory. Each
# module held costs every fork a little, so rarely used ones (statistics, datetime) are left out.
_PRELOAD = (
    "collections", "heapq", "itertools", "functools", "math", "bisect", "re", "string", "random",
    "operator", "copy", "typing",
)  # fmt: skip

# Longer code is compiled in the child, under its limits: the compiler's time and memory grow
# with the source, and the executor has no limits of its own.
_EXECUTOR_COMPILE_LIMIT = 64 << 10
# Without a dedicated uid the task limit must leave room for the user's other tasks; counting
# them scans /proc, so the count is refreshed at most this often (seconds).
_TASK_COUNT_TTL = 1.0
_CHECK_CACHE_SIZE = 1024  # compiled humaneval checks kept per worker (and executor)
_KILL_MARGIN = 2.0  # seconds allowed for killing and reaping a job beyond its deadline

if TYPE_CHECKING:
    from mars2.sandbox import judge


# --- framed messages between worker and executor --------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _send(fd: int, header: dict[str, Any], blob: bytes = b"") -> None:
    head = json.dumps(header).encode()
    _write_all(fd, struct.pack("!II", len(head), len(blob)) + head + blob)


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    parts, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                return None
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _recv(fd: int, deadline: float | None = None) -> tuple[dict[str, Any], bytes] | None:
    """One message, or None on EOF or when `deadline` (monotonic) passes first."""
    sizes = _read_exact(fd, 8, deadline)
    if sizes is None:
        return None
    head_size, blob_size = struct.unpack("!II", sizes)
    head = _read_exact(fd, head_size, deadline)
    blob = _read_exact(fd, blob_size, deadline) if blob_size else b""
    if head is None or blob is None:
        return None
    return json.loads(head), blob


# --- executor: forks the answers, never sees an expected output -----------------------------


class Executor:
    """Runs in its own process; see the module docstring."""

    def __init__(
        self, config: dict[str, Any], uid: int | None, dropper: UidDropper, job_parent: str
    ) -> None:
        self.config = config
        self.uid = uid
        self.dropper = dropper
        self.job_parent = job_parent
        self.is_init = (
            os.getpid() == 1
        )  # init of the jobs' pid namespace: kill(-1) reaches them all
        self.private_tmp = job_parent == "/tmp"
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
        apply_inherited_limits(
            file_bytes=int(config["file_size_mb"]) << 20,
            # RLIMIT_NPROC does not bind root: set here, it binds the job once it drops to its
            # own uid. With a shared uid it depends on the uid's running tasks: set per child.
            max_tasks=self._max_tasks() if uid is not None else None,
        )
        try:
            dropper.lock_down()
            self.locked_down = True
        except OSError:
            self.locked_down = False  # each child tries again, and fails its job if it cannot
        self._warm_up()

    def _new_workdir(self) -> str:
        workdir = make_private_dir(self.job_parent, "job-")
        if self.uid is not None:
            os.chown(workdir, self.uid, self.uid)
        # Set here once, inherited by every child: nothing of the trainer's environment remains.
        os.environ["HOME"] = workdir
        os.environ["TMPDIR"] = workdir
        os.chdir(workdir)
        return workdir

    def _max_tasks(self) -> int:
        return int(self.config["max_processes"]) + int(self.config["max_threads"])

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
            message = _recv(rfd)
            if message is None:
                return  # the worker is gone; as init, our exit takes every job with us
            header, _ = message
            if header.get("stop"):
                continue  # meant for a child that had already finished
            reply, blob = self._run(header)
            _send(wfd, reply, blob)

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
        running_tasks = self._running_tasks()
        began = time.monotonic()
        # What this job made stays out of the children's collections; frozen here, where the
        # pages are still writable without a copy.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the answer's process
            try:
                os.close(read_fd)
                self._enter_child(cpu_seconds, write_fd, running_tasks)

                def emit(result: dict[str, Any]) -> None:
                    _write_all(write_fd, (harness.encode_result(result) + "\n").encode())

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
                backstop = wall_limit * (harness.WALL_EXTENSIONS + 1) + self.config["grace"]
                wait = min(last_line_at + backstop, deadline) - now
                ready = select.select(watched, [], [], wait)[0] if wait > 0 else []
                if not ready:
                    outcome = "deadline" if time.monotonic() >= deadline else "hung"
                    break
                if self._from_worker in ready:
                    message = _recv(self._from_worker, time.monotonic() + 1.0)
                    if message is None or message[0].get("stop"):
                        outcome = "stopped"
                        break
                if read_fd not in ready:
                    continue
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break  # EOF: the child exited, crashed or closed the channel
                if streaming or harness.PROGRESS_END in chunk:
                    _send(
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
        deadline = time.monotonic() + _KILL_MARGIN
        if self.is_init:
            # Orphans of the job were re-parented to us: reap them, bounded in time.
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        time.sleep(0.0005)
                except ChildProcessError:
                    break
        elif self.uid is not None and os.geteuid() == 0:
            kill_uid(self.uid, deadline)
        return status, cpu

    def _clean(self) -> None:
        """Empty the job directory and the private /tmp, /dev/shm for the next job."""
        try:
            if os.listdir(self.workdir):  # most jobs leave nothing: skip the walk
                remove_tree(self.workdir, keep_top=True)
            os.chmod(self.workdir, 0o700)
            if self.private_tmp and os.listdir("/dev/shm"):
                remove_tree("/dev/shm", keep_top=True)
            if not os.listdir(self.workdir):
                return
        except OSError:
            pass
        remove_tree(self.workdir)  # what could not be emptied is left for the worker's close
        self.workdir = self._new_workdir()

    def _running_tasks(self) -> int:
        """Tasks the child's uid already runs: 0 for a dedicated uid, else a recent count."""
        if self.uid is not None:
            return 0
        now = time.monotonic()
        if now - self._tasks_counted_at > _TASK_COUNT_TTL:
            self._tasks = count_tasks_of(os.getuid())
            self._tasks_counted_at = now
        return self._tasks

    def _enter_child(self, cpu_seconds: int, result_fd: int, running_tasks: int) -> None:
        # Every page the child writes is a copy-on-write fault, the main cost of a job: the
        # executor froze its objects before forking (the collector never walks them), and the
        # setup below stays at raw syscalls.
        # The working directory, fds 0-2 (/dev/null), the file-size and (for a dedicated uid)
        # task limits are the executor's own, inherited.
        os.setpgid(0, 0)
        # Nothing of the executor's may reach user code: only the result pipe stays open.
        os.closerange(3, result_fd)
        os.closerange(result_fd + 1, 1 << 16)
        self.dropper.drop()
        if not self.locked_down:
            self.dropper.lock_down()
        apply_limits(
            memory_bytes=int(self.config["memory_mb"]) << 20,
            cpu_seconds=cpu_seconds,
            max_tasks=None if self.uid is not None else self._max_tasks() + running_tasks,
        )


# --- worker: the judge -----------------------------------------------------------------------


class ExecutorLost(RuntimeError):
    """The executor died or stopped answering; the worker must be replaced."""


class Worker:
    """Judges jobs one at a time; its executor runs them under the limits in `config`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.report = IsolationReport()
        uid = config.get("sandbox_uid")
        self.uid: int | None = uid if (uid is not None and os.geteuid() == 0) else None
        # Probed before the pid namespace exists: the first child forked after it becomes its init.
        dropper = UidDropper(self.uid, self.report)
        failure = probe_seccomp(dropper) if dropper.seccomp_ok else None
        if failure is not None:
            dropper._fprog = None
            self.report.missing.append(f"seccomp filter ({failure}); no_new_privs only")
        self.report.seccomp = dropper._fprog is not None
        job_parent, self.scratch_root = isolate_worker(
            config["scratch_dir"],
            config["allow_network"],
            config["readonly_root"],
            int(config.get("tmp_size_mb", 64)),
            self.report,
            bool(config.get("pid_namespace", True)),
        )
        if uid is not None and self.uid is None:
            self.report.missing.append("dedicated uid (not root): task limit shared with this user")
        self.report.sandbox_uid = self.uid
        for name in _PRELOAD + tuple(m for mods in PRELOAD_MODULES.values() for m in mods):
            __import__(name)
        self._checks: dict[str, tuple[str, judge.RewrittenCheck | None]] = {}
        self._sent: set[str] = set()
        self._reset_checks = False
        self.broken = False
        # Fork the executor now, before any job (and so any expected output) is in memory.
        to_exec_r, self._to_exec = os.pipe()
        self._from_exec, from_exec_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                dropper._prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the worker
                os.close(self._to_exec)
                os.close(self._from_exec)
                devnull = os.open(os.devnull, os.O_RDWR)
                # The pool's protocol pipes are the worker's alone; jobs inherit these three.
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                Executor(config, self.uid, dropper, job_parent).serve(to_exec_r, from_exec_w)
            except BaseException:
                code = 1
            os._exit(code)
        os.close(to_exec_r)
        os.close(from_exec_w)
        self.executor_pid = pid
        # Imported only now: the executor (and so every fork of it) never holds `ast` and the judge.
        global judge
        from mars2.sandbox import judge

    def close(self) -> None:
        for fd in (self._to_exec, self._from_exec):
            try:
                os.close(fd)
            except OSError:
                pass
        self._stop_executor(wait=2.0)
        if self.scratch_root is not None:
            remove_tree(self.scratch_root)

    def _stop_executor(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                if os.waitpid(self.executor_pid, os.WNOHANG)[0] != 0:
                    return
            except ChildProcessError:
                return
            time.sleep(0.005)
        try:
            os.kill(self.executor_pid, signal.SIGKILL)
            os.waitpid(self.executor_pid, 0)
        except (OSError, ChildProcessError):
            pass

    # -- checks ---------------------------------------------------------------------------------

    def _check_for(self, source: str) -> tuple[str, judge.RewrittenCheck | None]:
        entry = self._checks.get(source)
        if entry is None:
            if len(self._checks) >= _CHECK_CACHE_SIZE:
                self._checks.clear()
                self._sent.clear()
                self._reset_checks = True
            entry = (str(len(self._checks)) + ":" + str(id(source)), judge.rewrite_check(source))
            self._checks[source] = entry
        return entry

    def _executor_job(self, job: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """What the executor gets: inputs only; humaneval checks with their expectations lifted."""
        spec: dict[str, Any] = {
            "code": job["code"],
            "kind": job["kind"],
            "inputs": judge.tests_inputs(job["tests"]),
            "fn_name": job.get("fn_name"),
            "profile": job["profile"],
            "output_limit": int(job.get("output_limit", self.config["output_limit"])),
            "early_stop": bool(job.get("early_stop", False)),
        }
        checks: list[judge.RewrittenCheck | None] = []
        if job["kind"] == "humaneval":
            keys, shipped = [], []
            for source in spec["inputs"]:
                key, rewritten = self._check_for(source)
                checks.append(rewritten)
                keys.append(key if rewritten is not None else None)
                if rewritten is not None and key not in self._sent:
                    shipped.append([key, rewritten.source()])  # compiled by the executor
                    self._sent.add(key)
            # The check text still goes to the child (it compiles it when no code is shipped),
            # but only the rewritten one: no literal expectation in it.
            spec["inputs"] = [
                "" if check is not None else source for check, source in zip(checks, spec["inputs"])
            ]
            spec["check_keys"], spec["checks"] = keys, shipped
            if self._reset_checks:
                spec["reset_checks"], self._reset_checks = True, False
        return spec, checks

    # -- one job --------------------------------------------------------------------------------

    def run_job(self, job: dict[str, Any]) -> dict[str, Any]:
        tests = job["tests"]
        count = len(tests)
        job.setdefault("profile", "lenient")
        profile = get_profile(job["profile"])
        cpu_limit = float(job.get("per_test_timeout", self.config["per_test_timeout"]))
        wall_limit = cpu_limit * float(self.config.get("wall_factor", 3.0)) + 1.0
        configured = float(job.get("job_timeout", self.config["job_timeout"]))
        deadline = time.monotonic() + profile.job_wall_bound(cpu_limit, count, configured)
        spec, checks = self._executor_job(job)
        rows: list[dict[str, Any] | None] = [None] * count
        retries = int(self.config.get("overload_retries", 1))
        start, segments, first = 0, 0, True
        while start < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fill(rows, start, harness.TIMEOUT, "job time limit exceeded")
                break
            request: dict[str, Any] = {
                "start": start, "cpu_limit": cpu_limit, "wall_limit": wall_limit,
                "remaining": remaining,
            }  # fmt: skip
            if first:
                request["job"], first = spec, False
            watch = judge.Watch(
                start, tests, job["kind"], profile.name, cpu_limit, checks,
                bool(job.get("early_stop")),
            )  # fmt: skip
            reply = self._ask_executor(request, remaining + _KILL_MARGIN + 1.0, watch.feed)
            segments += 1
            if reply is None:
                self._fill(rows, start, harness.TIMEOUT, "the sandbox stopped answering")
                break
            header, blob = reply
            if "compile_error" in header:
                error = harness._clip(str(header["compile_error"]))
                self._fill(rows, start, harness.COMPILE_ERROR, error)
                break
            records, junk, _ = judge.parse_records(judge.strip_progress(blob), start, count)
            for record in records:
                index = record["index"]
                check = checks[index] if checks else None
                rows[index] = judge.judge_record(
                    record, tests[index]["output"], job["kind"], profile.name, cpu_limit, check
                )
            start += len(records)
            halfway = watch.failed_row
            if halfway and halfway["index"] == start:
                # An assert of this test failed: the check ends there, whatever the child did next.
                rows[start] = halfway
                start += 1
                if job.get("early_stop"):
                    break  # the rest are skipped below
                continue  # the rest run in a fresh child
            tripped = bool(records) and records[-1]["status"] == harness.WALL
            last = rows[start - 1] if records else None
            if tripped and last is not None and last["verdict"] == harness.OVERLOADED and retries:
                retries -= 1
                start -= 1  # run the starved test again in a fresh child
                continue
            if job.get("early_stop") and any(
                r is not None and r["verdict"] != harness.PASSED for r in rows
            ):
                break  # the rest are skipped below
            if tripped:
                continue  # the child stopped after its wall-clock net; go on from the next test
            if start >= count:
                break
            if junk:
                rows[start] = self._row(
                    start, harness.RUNTIME_ERROR, "wrote to the sandbox's result channel"
                )
                start += 1
                continue
            row = self._stopped_row(start, header, records, cpu_limit)
            if row["verdict"] == harness.OVERLOADED and retries > 0 and header["outcome"] == "hung":
                retries -= 1
                continue
            rows[start] = row
            start += 1
            if header["outcome"] == "deadline":
                verdict = row["verdict"]
                self._fill(rows, start, verdict, "job time limit exceeded")
                break
        if job.get("early_stop"):
            failed = next(
                (i for i, r in enumerate(rows) if r and r["verdict"] != harness.PASSED), None
            )
            if failed is not None:
                for i in range(failed + 1, count):
                    rows[i] = {"index": i, "verdict": harness.SKIPPED}
        return {"id": job.get("id"), "results": rows, "children": segments}

    @staticmethod
    def _row(index: int, verdict: str, error: str) -> dict[str, Any]:
        return {"index": index, "verdict": verdict, "error": error}

    def _fill(
        self, rows: list[dict[str, Any] | None], start: int, verdict: str, error: str
    ) -> None:
        for i in range(start, len(rows)):
            if rows[i] is None:
                rows[i] = self._row(i, verdict, error)

    def _stopped_row(
        self,
        index: int,
        header: dict[str, Any],
        records: list[dict[str, Any]],
        cpu_limit: float,
    ) -> dict[str, Any]:
        """The verdict of the test the child never reported."""
        if header["outcome"] in ("hung", "deadline"):
            before = float(records[-1].get("cpu_total", 0.0)) if records else 0.0
            used = max(0.0, float(header["cpu"]) - before)
            verdict, error = judge.wall_trip_verdict(
                used, float(header["elapsed"]), None, cpu_limit
            )
            if header["outcome"] == "deadline" and verdict == harness.TIMEOUT:
                error = "job time limit exceeded"
            return self._row(index, verdict, error)
        status = header.get("status")
        if status is None:
            return self._row(index, harness.RUNTIME_ERROR, "the process vanished")
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGXCPU:  # RLIMIT_CPU ran out
                return self._row(index, harness.TIMEOUT, "CPU time limit exceeded")
            name = signal.Signals(sig).name
            return self._row(index, harness.RUNTIME_ERROR, f"killed by {name}")
        return self._row(
            index, harness.RUNTIME_ERROR, f"process exited with code {os.WEXITSTATUS(status)}"
        )

    def _ask_executor(
        self,
        request: dict[str, Any],
        timeout: float,
        on_progress: Callable[[bytes], bool] | None = None,
    ) -> tuple[dict[str, Any], bytes] | None:
        """Send one request and wait for its reply, passing the child's output on to
        `on_progress` as it streams in (the child is stopped once that returns True); None (and
        the executor killed) if no reply comes in time."""
        deadline = time.monotonic() + timeout
        stop_sent = False
        try:
            _send(self._to_exec, request)
            while True:
                reply = _recv(self._from_exec, deadline)
                if reply is None or not reply[0].get("progress"):
                    break
                if on_progress is not None and on_progress(reply[1]) and not stop_sent:
                    _send(self._to_exec, {"stop": True})
                    stop_sent = True
        except OSError:
            reply = None
        if reply is None:
            # As init of the jobs' pid namespace, its death kills every job process too.
            self.broken = True
            self._stop_executor(wait=0.0)
        return reply


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
            if worker.broken:
                break  # the pool starts a fresh worker for the next job
    finally:
        worker.close()


if __name__ == "__main__":
    main()
