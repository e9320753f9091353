"""Run one job's tests inside the current process and report a verdict per test.

Standard library only: the local sandbox imports it in its forked children, and the E2B sandbox
ships this file's source verbatim to the remote machine. All tests of a job run in one process, so
grading costs one fork per job rather than one per test.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring_ascii as _quote
from types import CodeType
from typing import Any

try:  # inside the mars2 package; E2B ships compare.py and prelude.py next to this file
    from mars2.sandbox.compare import clip, compare_stdout
    from mars2.sandbox.compare import call_values_equal as compare_call
except ImportError:
    from compare import clip, compare_stdout  # type: ignore[no-redef]
    from compare import call_values_equal as compare_call  # type: ignore[no-redef]

PASSED = "passed"
WRONG_ANSWER = "wrong_answer"
TIMEOUT = "timeout"
RUNTIME_ERROR = "runtime_error"
MEMORY_EXCEEDED = "memory_exceeded"
OUTPUT_LIMIT = "output_limit"
COMPILE_ERROR = "compile_error"
SKIPPED = "skipped"

TEXT_CAP = 2000  # characters of actual output / error kept per test for feedback


class _TestTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so that `except Exception` in user code cannot swallow it."""


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
    if type(value) is str:
        return _quote(value)
    if type(value) is int or (type(value) is float and value - value == 0.0):  # finite floats
        return repr(value)
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


def _on_alarm(signum: int, frame: Any) -> None:
    raise _TestTimeout()


def _fake_exit(code: int = 0) -> None:
    # os._exit would end the process before its output is judged: treat it like sys.exit.
    raise SystemExit(code)


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


def _classify(err: BaseException) -> str:
    if isinstance(err, _TestTimeout):
        return TIMEOUT
    if isinstance(err, _OutputLimit):
        return OUTPUT_LIMIT
    if isinstance(err, MemoryError):
        return MEMORY_EXCEEDED
    if isinstance(err, AssertionError):
        return WRONG_ANSWER
    return RUNTIME_ERROR


def _error_text(err: BaseException) -> str:
    if isinstance(err, _TestTimeout):
        return "time limit exceeded"
    if isinstance(err, _OutputLimit):
        return "output limit exceeded"
    lines = traceback.format_exception(type(err), err, err.__traceback__)
    # Keep the user's frames: drop the harness's own.
    kept = [ln for ln in lines if "harness.py" not in ln]
    return _clip("".join(kept))


def _find_callable(namespace: dict[str, Any], fn_name: str) -> Callable[..., Any]:
    solution_cls = namespace.get("Solution")
    if isinstance(solution_cls, type) and hasattr(solution_cls, fn_name):
        return getattr(solution_cls(), fn_name)
    fn = namespace.get(fn_name)
    if callable(fn):
        return fn
    raise NameError(f"no function or Solution method named {fn_name!r}")


def compile_solution(code: str) -> CodeType:
    """Compile user code as its own module: no `__future__` flags are inherited from this file."""
    return compile(code, "<solution>", "exec", dont_inherit=True)


def compile_error_results(err: BaseException, start: int, count: int) -> list[dict[str, Any]]:
    """The results of tests[start:count] for code that does not compile."""
    error = _clip(f"{type(err).__name__}: {err}")
    return [{"index": i, "verdict": COMPILE_ERROR, "error": error} for i in range(start, count)]


def run_tests(
    code: str,
    kind: str,
    tests: list[dict[str, str]],
    emit: Callable[[dict[str, Any]], None],
    *,
    fn_name: str | None = None,
    start: int = 0,
    per_test_timeout: float = 6.0,
    output_limit: int = 1 << 20,
    early_stop: bool = False,
    scratch: str | None = None,
    solution: CodeType | None = None,
    test_code: Sequence[CodeType | None] | None = None,
) -> None:
    """Run tests[start:] against `code`, calling `emit` with one result dict per test, in order.

    `solution` is `code` already compiled, if the caller did it; `test_code` optionally holds the
    humaneval check sources already compiled (None where not).
    """
    real_stdout, real_stderr, real_stdin = sys.stdout, sys.stderr, sys.stdin
    real_exit = os._exit
    signal.signal(signal.SIGALRM, _on_alarm)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    try:
        compiled = solution if solution is not None else compile_solution(code)
    except (SyntaxError, ValueError, MemoryError) as err:
        for row in compile_error_results(err, start, len(tests)):
            emit(row)
        return
    os._exit = _fake_exit  # type: ignore[assignment]
    namespace: dict[str, Any] | None = None
    try:
        for index in range(start, len(tests)):
            test = tests[index]
            out, err_sink = _CappedText(output_limit), _CappedText(output_limit)
            result: dict[str, Any] = {"index": index}
            began = time.perf_counter()
            try:
                sys.stdout, sys.stderr = out, err_sink
                signal.setitimer(signal.ITIMER_REAL, per_test_timeout)
                try:
                    if kind == "stdin":
                        _set_stdin(test["input"], scratch)
                        try:
                            exec(compiled, {"__name__": "__main__", "__builtins__": builtins})
                        except SystemExit as stop:
                            if stop.code not in (None, 0):
                                raise RuntimeError(f"exit code {stop.code}") from None
                        verdict = (
                            PASSED
                            if compare_stdout(out.getvalue(), test["output"])
                            else WRONG_ANSWER
                        )
                        result["actual"] = _clip(out.getvalue())
                    else:
                        if namespace is None:
                            namespace = {"__name__": "__solution__", "__builtins__": builtins}
                            exec(compiled, namespace)
                        assert fn_name is not None
                        if kind == "call":
                            args = [
                                json.loads(line)
                                for line in test["input"].split("\n")
                                if line.strip()
                            ]
                            value = _find_callable(namespace, fn_name)(*args)
                            verdict = (
                                PASSED
                                if compare_call(value, json.loads(test["output"]))
                                else WRONG_ANSWER
                            )
                            result["actual"] = _clip(repr(value))
                        else:  # humaneval: the test source defines check(candidate)
                            check = test_code[index] if test_code else None
                            if check is None:
                                check = compile(
                                    test["input"], "<string>", "exec", dont_inherit=True
                                )
                            exec(check, namespace)
                            namespace["check"](namespace[fn_name])
                            verdict = PASSED
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    sys.stdout, sys.stderr = real_stdout, real_stderr
            except BaseException as err:
                if isinstance(err, KeyboardInterrupt):
                    raise
                verdict = _classify(err)
                result["error"] = _error_text(err)
                if kind == "stdin":
                    result["actual"] = _clip(out.getvalue())
            result["verdict"] = verdict
            result["time"] = round(time.perf_counter() - began, 6)
            stderr_text = err_sink.getvalue()
            if stderr_text:
                result["stderr"] = _clip(stderr_text)
            emit(result)
            if early_stop and verdict != PASSED:
                for rest in range(index + 1, len(tests)):
                    emit({"index": rest, "verdict": SKIPPED})
                return
    finally:
        os._exit = real_exit
        sys.stdin = real_stdin


def main() -> None:
    """Entry point for remote runs: read a job as JSON from argv[1] (a file), print result lines."""
    with open(sys.argv[1], encoding="utf-8") as handle:
        job = json.load(handle)
    out = sys.stdout

    def emit(result: dict[str, Any]) -> None:
        out.write("@@MARS2@@" + encode_result(result) + "\n")
        out.flush()

    run_tests(
        job["code"],
        job["kind"],
        job["tests"],
        emit,
        fn_name=job.get("fn_name"),
        per_test_timeout=job.get("per_test_timeout", 6.0),
        output_limit=job.get("output_limit", 1 << 20),
        early_stop=job.get("early_stop", False),
        scratch=os.getcwd(),
    )


if __name__ == "__main__":
    main()
