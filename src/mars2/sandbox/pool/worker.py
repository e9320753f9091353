"""A sandbox worker: the judge of its jobs, outside the container its executor runs in.

Started by `LocalSandbox` as ``python -m mars2.sandbox.pool.worker`` from a clean interpreter
(never forked from a training process holding GPU state) with an allow-listed environment; its
first line on stdin is its `WorkerConfig`. Before it reads any job it starts its executor
(`mars2.sandbox.runner.executor`), inside one bubblewrap container where it has one (built by
`mars2.sandbox.container.bubblewrap`, with libseccomp's filter exported here and loaded by
bubblewrap on the executor). The worker
sends the executor a job's inputs only, keeps the expected outputs, validates the raw records and
decides the verdicts (`verdict.judge`), restarting the executor's child from the first test not
yet judged when one dies or hangs (`job_loop.JobLoop`). No answer can reach it: it runs outside
the container, in another pid namespace, or as root while jobs run under another uid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from mars2.sandbox.container import bubblewrap, seccomp
from mars2.sandbox.pool.job_loop import JobLoop
from mars2.sandbox.protocol import WorkerConfig, recv_message, send_message
from mars2.sandbox.runner.scratch import make_private_dir, remove_tree
from mars2.sandbox.verdict import judge

_CHECK_CACHE_SIZE = 1024  # compiled humaneval checks kept per worker (and executor)
_START_TIMEOUT = 60.0  # seconds an executor may take to start and warm up
EXECUTOR_MODULE = "mars2.sandbox.runner.executor"


class ExecutorLost(RuntimeError):
    """The executor died or stopped answering; the worker must be replaced."""


class Worker:
    """Judges jobs one at a time; its executor runs them under the limits in `config`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.host_scratch: str | None = None
        self.hidden: list[str] = []
        self.unfiltered: list[str] = []  # refused calls the container's filters do not cover
        filter_fds: list[int] = []  # the exported seccomp programs, for bubblewrap to read
        if config.bwrap:
            root = os.geteuid() == 0
            keep = bubblewrap.interpreter_paths()
            # Without root, jobs run under this user's uid: their home (keys, tokens) is covered.
            home = None if root else bubblewrap.home_directory()
            private = [home] if home else []
            self.hidden = bubblewrap.hidden_directories(keep, private)
            prefix = bubblewrap.container_argv(
                config.bwrap, allow_network=config.allow_network,
                tmp_size_mb=config.tmp_size_mb, as_root=root, keep=keep, private=private,
            )  # fmt: skip
            if config.seccomp:
                programs, self.unfiltered = seccomp.export_programs()
                for program in programs:
                    read_end, write_end = os.pipe()
                    os.write(write_end, program)  # a few kB: well under a pipe's buffer
                    os.close(write_end)
                    filter_fds.append(read_end)
                    prefix += ["--add-seccomp-fd", str(read_end)]
            command = [*prefix, "--", bubblewrap.interpreter(), "-m", EXECUTOR_MODULE]
            job_parent = "/tmp"  # the container's private tmpfs
        else:
            # No container: job directories go on the host, under a directory of our own that
            # job uids may pass through, and which close() removes.
            if config.sandbox_uid is not None and os.geteuid() == 0:
                closed = bubblewrap.closed_ancestor(os.path.realpath(config.scratch_dir))
                if closed is not None:
                    raise ExecutorLost(
                        f"scratch_dir {config.scratch_dir} is under {closed}, which the jobs' "
                        "uids cannot enter: choose a scratch_dir others may traverse (the "
                        "default is the temp directory)"
                    )
            self.host_scratch = make_private_dir(config.scratch_dir, "mars2-sandbox-")
            os.chmod(self.host_scratch, 0o711)
            command = [sys.executable, "-m", EXECUTOR_MODULE]
            job_parent = self.host_scratch
        self._checks: dict[str, tuple[str, judge.RewrittenCheck | None]] = {}
        self._sent: set[str] = set()
        self._reset_checks = False
        self.broken = False
        self.executor = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            pass_fds=filter_fds,
        )
        for fd in filter_fds:  # bubblewrap has its own copies
            os.close(fd)
        assert self.executor.stdin is not None and self.executor.stdout is not None
        self._to_exec = self.executor.stdin.fileno()
        self._from_exec = self.executor.stdout.fileno()
        try:
            send_message(self._to_exec, {"config": config.replace(job_parent=job_parent).to_json()})
            hello = recv_message(self._from_exec, time.monotonic() + _START_TIMEOUT)
        except OSError:
            hello = None
        if hello is None or not hello[0].get("ready"):
            said = (hello[0].get("error") if hello else None) or self._stderr()
            self.close()
            raise ExecutorLost(f"the executor did not start: {said}")
        self.executor_report: dict[str, Any] = hello[0]
        if self.unfiltered:
            self.executor_report["unfiltered"] = self.unfiltered

    def _stderr(self) -> str:
        """What the executor (or bubblewrap) said before it died."""
        self._stop_executor(wait=1.0)
        assert self.executor.stderr is not None
        try:
            text = self.executor.stderr.read(1 << 16).decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            text = ""
        return text.splitlines()[-1] if text else f"exit status {self.executor.returncode}"

    def close(self) -> None:
        for stream in (self.executor.stdin, self.executor.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self._stop_executor(wait=2.0)
        if self.executor.stderr is not None:
            self.executor.stderr.close()
        if self.host_scratch is not None:
            remove_tree(self.host_scratch)
            self.host_scratch = None

    def _stop_executor(self, wait: float) -> None:
        try:
            self.executor.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass
        self.executor.kill()  # in a container: bubblewrap, whose death takes the executor along
        self.executor.wait()

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
            "profile": job.get("profile") or "lenient",
            "output_limit": int(job.get("output_limit") or self.config.output_limit),
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
        """Run one job (tests, kind, code, limits) and judge it: the reply line for the pool."""
        spec, checks = self._executor_job(job)
        loop = JobLoop(job, self.config, checks, time.monotonic())
        first = True
        while (request := loop.next_request(time.monotonic())) is not None:
            if first:
                request["job"], first = spec, False
            watch = loop.watch
            reply = self._ask_executor(
                request, loop.reply_timeout(request), watch.feed if watch is not None else None
            )
            if reply is None:
                loop.executor_lost()
                break
            loop.on_reply(*reply)
        rows = [row.to_dict() if row is not None else None for row in loop.results()]
        return {"id": job.get("id"), "results": rows, "children": loop.segments}

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
            send_message(self._to_exec, request)
            while True:
                reply = recv_message(self._from_exec, deadline)
                if reply is None or not reply[0].get("progress"):
                    break
                if on_progress is not None and on_progress(reply[1]) and not stop_sent:
                    send_message(self._to_exec, {"stop": True})
                    stop_sent = True
        except OSError:
            reply = None
        if reply is None:
            # In a container it is init of the jobs' pid namespace: its death kills them all.
            self.broken = True
            self._stop_executor(wait=0.0)
        return reply


def main() -> None:
    """Serve jobs from stdin until it closes; the first line in is the config, the first line out
    says what the executor set up (or why it could not start)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool owns our lifetime, not the terminal
    out = os.fdopen(os.dup(1), "w", buffering=1)
    config = WorkerConfig.from_json(sys.stdin.readline())
    try:
        worker = Worker(config)
    except (ExecutorLost, OSError) as err:
        out.write(json.dumps({"ready": False, "error": str(err)}) + "\n")
        return
    hello = {"ready": True, "executor": worker.executor_report, "hidden": worker.hidden}
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
