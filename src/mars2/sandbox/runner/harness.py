"""Run one job's tests inside the current (answer's) process and report each test's raw outcome.

The harness never decides a verdict and never sees an expected output: for each test it reports
what the answer did (its stdout, the returned value as plain data, what humaneval checks
reported, how it ended, the CPU and wall time it used) and the judge (`mars2.sandbox.verdict.judge`, in
another process) compares. Standard library only (plus the loose `compare`/`prelude` modules): the
local sandbox runs it in forked children, and the E2B sandbox ships this file verbatim to the
remote machine. All tests of a job run in one process, so grading costs one fork per job.
"""

from __future__ import annotations

import builtins
import io
import json
import linecache
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring_ascii as _quote
from types import CodeType
from typing import Any

try:  # the C function: `signal.signal` wraps it in enum conversions that cost a freshly forked
    # child a few dozen copy-on-write page faults
    from _signal import signal as _set_handler  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - not CPython
    _set_handler = signal.signal

try:  # inside the mars2 package; E2B ships compare.py and prelude.py next to this file
    from mars2.sandbox.verdict import prelude as _prelude
    from mars2.sandbox.verdict.compare import clip, encode_value, find_callable, get_profile
except ImportError:
    import prelude as _prelude  # type: ignore[no-redef]
    from compare import clip, encode_value, find_callable, get_profile  # type: ignore[no-redef]

PASSED = "passed"
WRONG_ANSWER = "wrong_answer"
TIMEOUT = "timeout"
RUNTIME_ERROR = "runtime_error"
MEMORY_EXCEEDED = "memory_exceeded"
OUTPUT_LIMIT = "output_limit"
COMPILE_ERROR = "compile_error"
SKIPPED = "skipped"
OVERLOADED = "overloaded"
# A fault of ours, not of the answer (worker killed, sandbox creation failed): never a wrong answer.
INFRA_ERROR = "infra_error"

# How a test ended, as the harness reports it ("status"); the judge turns it into a verdict.
OK = "ok"
WALL = "wall"  # the wall-clock safety net tripped before the CPU budget: idle or starved

TEXT_CAP = 2000  # characters of actual output / error kept per test for feedback
# A test that spent at least this share of its wall time waiting for a CPU (or, where the wait is
# not measurable, running on one) was starved by other load rather than idle.
BUSY_SHARE = 0.2
# How many more times a starved test's wall-clock net is re-armed before it is given up on: the
# CPU-time limit, not the machine's load, should end a busy test.
WALL_EXTENSIONS = 3
_SIGPROF, _SIGALRM = int(signal.SIGPROF), int(signal.SIGALRM)
_SIGVTALRM = int(signal.SIGVTALRM)
REPORT_NAME = "__mars2_report__"  # how rewritten humaneval checks hand values to the judge

# Progress frames: while a long test runs, what it has done so far goes out every
# PROGRESS_EVERY seconds of its CPU time, so that the judge can stop it as soon as the verdict is
# known (a humaneval assert that failed, a wrong answer under early stop). A frame is a record
# line's JSON ended by PROGRESS_END instead of a newline; it fits one atomic pipe write.
PROGRESS_END = b"\x00"
PROGRESS_EVERY = 0.01
PROGRESS_CAP = 4000  # bytes per frame, under PIPE_BUF
_FRAME_OVERHEAD = 40  # bytes of a frame that are not reports: its head, brackets and end


class _CpuTimeout(BaseException):
    """Raised by SIGPROF; a BaseException, so `except Exception` in user code cannot swallow it."""


class _WallTimeout(BaseException):
    """Raised by SIGALRM: the test's wall-clock safety net."""


class _OutputLimit(BaseException):
    """Raised when a test prints more than the output cap."""


def _clip(text: str, cap: int = TEXT_CAP) -> str:
    return clip(text, cap)


# --- result lines ----------------------------------------------------------------------------


def encode_result(result: dict[str, Any]) -> str:
    """A result dict as one line of JSON.

    Written out by hand for the usual value types: `json.dumps` runs enough Python to cost a freshly
    forked child dozens of copy-on-write page faults.
    """
    return "{" + ", ".join(_quote(k) + ": " + _json_value(v) for k, v in result.items()) + "}"


def _json_value(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return _quote(value)
    if kind is int or (kind is float and value - value == 0.0):  # finite floats
        return repr(value)
    if value is None or kind is bool:
        return "null" if value is None else ("true" if value else "false")
    if kind is list:
        return "[" + ", ".join([_json_value(v) for v in value]) + "]"
    if kind is dict and all(type(k) is str for k in value):
        return "{" + ", ".join([_quote(k) + ": " + _json_value(v) for k, v in value.items()]) + "}"
    return json.dumps(value)


# --- capped output capture -------------------------------------------------------------------


class _CappedBytes(io.RawIOBase):
    def __init__(self, owner: _CappedText) -> None:
        self._owner = owner

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._owner.write(bytes(data).decode("utf-8", "replace"))
        return len(data)


class _CappedText(io.TextIOBase):
    """A text sink that raises `_OutputLimit` once more than `cap` characters were written."""

    def __init__(self, cap: int) -> None:
        self._parts: list[str] = []
        self._size = 0
        self._cap = cap
        self.buffer = _CappedBytes(self)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._size += len(text)
        if self._size > self._cap:
            raise _OutputLimit()
        self._parts.append(text)
        return len(text)

    def getvalue(self) -> str:
        return "".join(self._parts)


# --- running ---------------------------------------------------------------------------------


def _on_cpu_limit(signum: int, frame: Any) -> None:
    raise _CpuTimeout()


class _WallNet:
    """The current test's wall-clock net: re-armed while the test is starved, not idle."""

    def __init__(self, wall_limit: float, delay_at_start: float | None) -> None:
        self.wall_limit = wall_limit
        self.delay_at_start = delay_at_start
        self.began = 0.0
        self.cpu_began = 0.0
        self.left = 0

    def arm(self, began: float, cpu_began: float) -> None:
        self.began, self.cpu_began, self.left = began, cpu_began, WALL_EXTENSIONS
        signal.setitimer(signal.ITIMER_REAL, self.wall_limit)

    def delay(self) -> float | None:
        now = run_delay()
        if now is None or self.delay_at_start is None:
            return None
        return now - self.delay_at_start

    def on_alarm(self, signum: int, frame: Any) -> None:
        if self.left > 0:
            wall = time.perf_counter() - self.began
            waited = self.delay()
            if waited is None:
                waited = time.process_time() - self.cpu_began
            if waited >= BUSY_SHARE * wall:
                self.left -= 1
                signal.setitimer(signal.ITIMER_REAL, self.wall_limit)
                return
        raise _WallTimeout()


def _fake_exit(code: int = 0) -> None:
    # os._exit would end the process before its output is reported: treat it like sys.exit.
    raise SystemExit(code)


def run_delay() -> float | None:
    """Seconds this process has waited for a CPU while runnable (schedstat), None if unknown."""
    try:
        with open("/proc/self/schedstat", "rb") as handle:
            return int(handle.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _set_stdin(text: str, scratch: str | None) -> None:
    if scratch is not None:
        # Back fd 0 with a real file, so that `open(0).read()` also sees the input.
        path = os.path.join(scratch, ".stdin")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        fd = os.open(path, os.O_RDONLY)
        if fd != 0:  # fd 0 may be free: user code's open(0) closes it when collected
            os.dup2(fd, 0)
            os.close(fd)
    sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode("utf-8")), encoding="utf-8")


def _status_of(err: BaseException) -> str:
    if isinstance(err, _CpuTimeout):
        return TIMEOUT
    if isinstance(err, _WallTimeout):
        return WALL
    if isinstance(err, _OutputLimit):
        return OUTPUT_LIMIT
    if isinstance(err, MemoryError):
        return MEMORY_EXCEEDED
    if isinstance(err, AssertionError):
        return WRONG_ANSWER  # a humaneval assert that ran beside the answer failed
    return RUNTIME_ERROR


def _error_text(err: BaseException, code: str | None = None) -> str:
    """The feedback text of an exception: the answer's frames (with the line of `code` they
    ran), chained exceptions, and the exception itself; the harness's own frames left out."""
    if isinstance(err, _CpuTimeout):
        return "time limit exceeded"
    if isinstance(err, _WallTimeout):
        return "wall-clock safety net exceeded"
    if isinstance(err, _OutputLimit):
        return "output limit exceeded"
    return _clip(_format_chain(err, code.splitlines() if code else []))


# `traceback.format_exception` costs a freshly forked child over a millisecond (it reads source
# files and parses lines to place carets): most answers fail, so the text is built directly.
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"
_REPEATS_SHOWN = 3  # identical consecutive frames (recursion) shown before they are counted
_CHAIN_SHOWN = 8  # exceptions of a chain (raise ... from, raised while handling) shown


def _format_chain(err: BaseException, source: list[str]) -> str:
    """The exception and up to `_CHAIN_SHOWN - 1` exceptions it was raised from or during, the
    oldest first (walked iteratively: a chain can be as long as the answer makes it)."""
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    current: BaseException | None = err
    link = ""
    while current is not None and id(current) not in seen and len(chain) < _CHAIN_SHOWN:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _CONTEXT
        else:
            current = None
    return "".join(_format_one(e, source) + link for e, link in reversed(chain))


def _format_one(err: BaseException, source: list[str]) -> str:
    frames: list[tuple[str, int, str]] = []
    tb = err.__traceback__
    while tb is not None:
        frame_code = tb.tb_frame.f_code
        if os.path.basename(frame_code.co_filename) != "harness.py":
            frames.append((frame_code.co_filename, tb.tb_lineno, frame_code.co_name))
        tb = tb.tb_next
    lines = ["Traceback (most recent call last):\n"] if frames else []
    index = 0
    while index < len(frames):
        run = 1
        while index + run < len(frames) and frames[index + run] == frames[index]:
            run += 1
        filename, line, name = frames[index]
        text = ""
        if filename == "<solution>":
            text = source[line - 1].strip() if 0 < line <= len(source) else ""
        elif not filename.startswith("<"):
            text = linecache.getline(filename, line).strip()
        entry = f'  File "{filename}", line {line}, in {name}\n' + (f"    {text}\n" if text else "")
        lines.extend([entry] * min(run, _REPEATS_SHOWN))
        if run > _REPEATS_SHOWN:
            lines.append(f"  [Previous line repeated {run - _REPEATS_SHOWN} more times]\n")
        index += run
    return "".join(lines) + _exception_line(err)


def _exception_line(err: BaseException) -> str:
    if isinstance(err, SyntaxError):  # its own layout (file, line, caret); rare at run time
        return "".join(traceback.format_exception_only(type(err), err))
    kind = type(err)
    name = kind.__qualname__
    if kind.__module__ not in ("__main__", "builtins"):
        name = f"{kind.__module__}.{name}"
    try:
        message = str(err)
    except BaseException:
        message = "<exception str() failed>"
    return f"{name}: {message}\n" if message else f"{name}\n"


def compile_solution(code: str) -> CodeType:
    """Compile user code as its own module: no `__future__` flags are inherited from this file."""
    return compile(code, "<solution>", "exec", dont_inherit=True)


def compile_error_results(err: BaseException, start: int, count: int) -> list[dict[str, Any]]:
    """The verdict rows of tests[start:count] for code that does not compile."""
    error = _clip(f"{type(err).__name__}: {err}")
    return [{"index": i, "verdict": COMPILE_ERROR, "error": error} for i in range(start, count)]


class _Run:
    """The state one child keeps across the tests of its job."""

    def __init__(
        self,
        code: str,
        compiled: CodeType,
        kind: str,
        fn_name: str | None,
        profile: str,
        scratch: str | None,
        test_code: Sequence[CodeType | None] | None,
        clean_builtins: dict[str, Any],
    ) -> None:
        self.code = code
        self.compiled = compiled
        self.kind = kind
        self.fn_name = fn_name
        self.profile = profile
        self.prelude = _prelude.compiled(profile) if get_profile(profile).prelude else None
        self.scratch = scratch
        self.test_code = test_code
        self.clean_builtins = clean_builtins
        self.namespace: dict[str, Any] | None = None
        self.function: Callable[..., Any] | None = None
        self.send_progress: Callable[[bytes], None] | None = None
        self.index = 0
        self.reports: list[Any] = []
        self.sent = 0  # reports of the current test already sent in progress frames
        self.live = False  # a progress frame may be sent now (never while a record is written)
        self.muted = False  # this test sends no more frames
        self.announced = False

    def on_progress_tick(self, signum: int, frame: Any) -> None:
        """Send the current test's new humaneval reports (or just a sign of life) as one frame."""
        if not self.live or self.muted or self.send_progress is None:
            return
        self.live = False  # a frame is never sent from inside another one
        try:
            parts, size = [], _FRAME_OVERHEAD
            for item in self.reports[self.sent :]:
                text = _json_value(item)
                if len(text) > PROGRESS_CAP - _FRAME_OVERHEAD:
                    # Judged from the test's record at the end, as is every report after it: the
                    # first failing assert is the one a verdict names.
                    self.muted = True
                    break
                if size + len(text) + 2 > PROGRESS_CAP:
                    break  # the rest goes in the next frame
                size += len(text) + 2
                parts.append(text)
            head = '{"index": ' + str(self.index) + ', "reports": ['
            if parts or not self.announced:  # the first frame tells the executor to stream
                self.send_progress((head + ", ".join(parts) + "]}").encode() + PROGRESS_END)
                self.announced = True
            self.sent += len(parts)
        except (RecursionError, MemoryError):
            # Out of stack or memory where the tick landed: the answer's own limits, not ours
            # to raise into its code. The test's record still holds every report.
            self.muted = True
        finally:
            self.live = True

    def _module(self) -> dict[str, Any]:
        """The answer's module namespace, run once per child for call and humaneval tests."""
        if self.namespace is None:
            namespace: dict[str, Any] = {"__name__": "__solution__", "__builtins__": builtins}
            if self.prelude is not None:
                exec(self.prelude, namespace)
            self.namespace = namespace
            exec(self.compiled, namespace)
        return self.namespace

    def stdin_test(self, text: str, out: _CappedText, result: dict[str, Any]) -> None:
        _set_stdin(text, self.scratch)
        namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        try:
            if self.prelude is not None:
                exec(self.prelude, namespace)
            exec(self.compiled, namespace)
        except SystemExit as stop:
            if stop.code not in (None, 0):
                result["exit"] = stop.code if type(stop.code) is int else 1
        finally:
            result["stdout"] = out.getvalue()

    def call_test(self, text: str, result: dict[str, Any]) -> None:
        namespace = self._module()
        assert self.fn_name is not None
        if self.function is None:
            self.function = find_callable(namespace, self.fn_name, self.code, self.profile)
        args = [json.loads(line) for line in text.split("\n") if line.strip()]
        result["value"] = encode_value(self.function(*args))

    def humaneval_test(self, index: int, text: str, result: dict[str, Any]) -> None:
        namespace = self._module()
        assert self.fn_name is not None
        check = self.test_code[index] if self.test_code else None
        if check is None:
            check = compile(text, "<check>", "exec", dont_inherit=True)
        reports: list[Any] = []
        result["reports"] = reports
        self.reports, self.sent = reports, 0

        def report(site: int, value: Any) -> None:
            reports.append([site, encode_value(value)])

        # The check runs with the builtins as they were before the answer ran, so the answer's
        # module code cannot redefine what the check's own code calls (abs, len, sorted...).
        check_globals = dict(namespace)
        check_globals["__builtins__"] = self.clean_builtins
        check_globals[REPORT_NAME] = report
        exec(check, check_globals)
        check_globals["check"](namespace[self.fn_name])


def run_tests(
    code: str,
    kind: str,
    inputs: Sequence[str],
    emit: Callable[[dict[str, Any]], None],
    *,
    fn_name: str | None = None,
    start: int = 0,
    cpu_limit: float = 6.0,
    wall_limit: float | None = None,
    output_limit: int = 1 << 20,
    profile: str = "lenient",
    scratch: str | None = None,
    solution: CodeType | None = None,
    test_code: Sequence[CodeType | None] | None = None,
    clean_builtins: dict[str, Any] | None = None,
    fresh: bool = False,
    stop_on_error: bool = False,
    send_progress: Callable[[bytes], None] | None = None,
) -> None:
    """Run the tests with `inputs[start:]` against `code`, emitting one raw record per test.

    A record holds "index", "status" (ok, timeout, wall, runtime_error, ...), "time" and "cpu"
    (seconds used by the test), "error"/"stderr" text, and the raw output: "stdout" (stdin
    tests), "exit" (a non-zero exit status), "value" (a call test's encoded return value) or
    "reports" (values rewritten humaneval asserts reported). `cpu_limit` is the per-test CPU-time
    budget (the `timeout` status); `wall_limit` a wall-clock safety net (the `wall` status),
    re-armed up to WALL_EXTENSIONS times while the test is starved of CPU rather than idle.
    `solution` is `code` already compiled, if the caller did it; `test_code` optionally holds the
    humaneval check sources already compiled (None where not). `fresh`: this process was just
    forked for the job (its CPU-wait counter starts at zero). `stop_on_error`: stop after the
    first test that did not end normally (early stop; a wrong output is only known to the judge).
    `send_progress`, where given, writes progress frames (see PROGRESS_END) while a humaneval test,
    or any test under early stop, runs: the judge may stop the process once it has a verdict.
    """
    real_stdout, real_stderr, real_stdin = sys.stdout, sys.stderr, sys.stdin
    real_exit = os._exit
    _set_handler(_SIGPROF, _on_cpu_limit)
    settings = get_profile(profile)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), settings.recursion_limit))
    if settings.int_max_str_digits is not None and hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(settings.int_max_str_digits)
    try:
        compiled = solution if solution is not None else compile_solution(code)
    except (SyntaxError, ValueError, MemoryError) as err:
        error = _clip(f"{type(err).__name__}: {err}")
        for index in range(start, len(inputs)):
            emit({"index": index, "status": COMPILE_ERROR, "error": error})
        return
    run = _Run(
        code, compiled, kind, fn_name, profile, scratch, test_code,
        clean_builtins if clean_builtins is not None else dict(builtins.__dict__),
    )  # fmt: skip
    # A forked child's schedstat starts at zero; elsewhere (E2B) the process ran before this.
    net = None if wall_limit is None else _WallNet(wall_limit, 0.0 if fresh else run_delay())
    if net is not None:
        _set_handler(_SIGALRM, net.on_alarm)
    ticking = send_progress is not None and (kind == "humaneval" or stop_on_error)
    if ticking:
        run.send_progress = send_progress
        _set_handler(_SIGVTALRM, run.on_progress_tick)
    os._exit = _fake_exit  # type: ignore[assignment]
    try:
        for index in range(start, len(inputs)):
            out, err_sink = _CappedText(output_limit), _CappedText(output_limit)
            result: dict[str, Any] = {"index": index, "status": OK}
            began, cpu_began = time.perf_counter(), time.process_time()
            try:
                sys.stdout, sys.stderr = out, err_sink
                signal.setitimer(signal.ITIMER_PROF, cpu_limit)
                if net is not None:
                    net.arm(began, cpu_began)
                if ticking:
                    run.index, run.reports, run.sent, run.muted = index, [], 0, False
                    run.live = True
                    signal.setitimer(signal.ITIMER_VIRTUAL, PROGRESS_EVERY, PROGRESS_EVERY)
                try:
                    if kind == "stdin":
                        run.stdin_test(inputs[index], out, result)
                    elif kind == "call":
                        run.call_test(inputs[index], result)
                    else:
                        run.humaneval_test(index, inputs[index], result)
                finally:
                    run.live = False  # from here on this test's record may be written
                    if ticking:
                        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.setitimer(signal.ITIMER_PROF, 0)
                    sys.stdout, sys.stderr = real_stdout, real_stderr
            except BaseException as err:
                if isinstance(err, KeyboardInterrupt):
                    raise
                result["status"] = _status_of(err)
                result["error"] = _error_text(err, code)
                if kind == "stdin":
                    result["stdout"] = out.getvalue()
                if net is not None and isinstance(err, _WallTimeout):
                    delay = net.delay()
                    if delay is not None:
                        result["delay"] = round(delay, 6)
            result["time"] = round(time.perf_counter() - began, 6)
            result["cpu"] = round(time.process_time() - cpu_began, 6)
            result["cpu_total"] = round(time.process_time(), 6)
            stderr_text = err_sink.getvalue()
            if stderr_text:
                result["stderr"] = _clip(stderr_text)
            emit(result)
            if result["status"] == WALL or (stop_on_error and result["status"] != OK):
                return  # the judge decides whether to run the rest (again)
    finally:
        os._exit = real_exit
        sys.stdin = real_stdin


MARKER = "@@MARS2@@"


def main() -> None:
    """Entry point for remote runs: read a job (inputs only) as JSON from argv[1], print records.

    Each record is printed on its own line after `MARKER`; anything else on stdout is ignored by
    the judge, which runs on the caller's side.
    """
    with open(sys.argv[1], encoding="utf-8") as handle:
        job = json.load(handle)
    out = sys.stdout

    def emit(result: dict[str, Any]) -> None:
        out.write(MARKER + encode_result(result) + "\n")
        out.flush()

    per_test = float(job.get("per_test_timeout", 6.0))
    run_tests(
        job["code"],
        job["kind"],
        job["inputs"],
        emit,
        fn_name=job.get("fn_name"),
        start=int(job.get("start", 0)),
        cpu_limit=per_test,
        wall_limit=float(job["wall_limit"]),  # the caller applies protocol.wall_limit
        output_limit=job.get("output_limit", 1 << 20),
        profile=job.get("profile", "lenient"),
        scratch=os.getcwd(),
        stop_on_error=bool(job.get("early_stop", False)),
    )


if __name__ == "__main__":
    main()
