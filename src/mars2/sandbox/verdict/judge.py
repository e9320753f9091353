"""Verdicts, decided outside the answer's process from the raw records the harness reports.

The local worker and the E2B sandbox both call `judge_record` on their own side: the answer's
process never holds an expected output (for humaneval checks, `rewrite_check` takes the literal
expected values out of the check before it is shipped to the child, and keeps them here).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from mars2.sandbox.protocol import ResultRow
from mars2.sandbox.runner import harness
from mars2.sandbox.verdict.compare import (
    Opaque,
    clip,
    compare_call,
    compare_stdout,
    decode_value,
    get_profile,
)

# Under this share of the wall time spent waiting for a CPU (or on one), a test that hit the
# wall-clock net was idle (sleeping, blocked): its own doing, so a timeout. Above it, it was
# starved by other load: overloaded, never a failing answer.
_BUSY_SHARE = harness.BUSY_SHARE

_STATUS_VERDICTS = {
    harness.TIMEOUT: harness.TIMEOUT,
    harness.OUTPUT_LIMIT: harness.OUTPUT_LIMIT,
    harness.MEMORY_EXCEEDED: harness.MEMORY_EXCEEDED,
    harness.RUNTIME_ERROR: harness.RUNTIME_ERROR,
    harness.WRONG_ANSWER: harness.WRONG_ANSWER,
    harness.COMPILE_ERROR: harness.COMPILE_ERROR,
}


def wall_trip_verdict(
    cpu: float, wall: float, delay: float | None, cpu_limit: float
) -> tuple[str, str]:
    """Judge a test stopped by the wall-clock net: `timeout` if it used its CPU budget or sat
    idle, `overloaded` if it was runnable but kept off the CPU by other load."""
    if cpu >= cpu_limit:
        return harness.TIMEOUT, "time limit exceeded"
    waited = delay if delay is not None else cpu
    if wall > 0 and waited >= _BUSY_SHARE * wall:
        return harness.OVERLOADED, (
            f"machine overloaded: {cpu:.2f} s of CPU in {wall:.2f} s of wall time"
        )
    return harness.TIMEOUT, f"time limit exceeded (idle: {cpu:.2f} s of CPU in {wall:.2f} s)"


# --- humaneval checks --------------------------------------------------------------------------


class Site:
    """One lifted assert: the child reports a value, this decides whether it is right."""

    __slots__ = ("expected", "kind", "line", "strict", "times", "tolerance")

    def __init__(
        self,
        kind: str,
        expected: Any,
        line: int,
        times: int,
        tolerance: float = 0.0,
        strict: bool = True,
    ) -> None:
        self.kind = kind  # eq | is | truthy | falsy | close
        self.expected = expected
        self.tolerance = tolerance
        self.strict = strict
        self.line = line
        # How many reports the check must make from this site (0: as many as it happens to).
        self.times = times

    def accepts(self, value: Any) -> bool:
        if isinstance(value, Opaque):
            return False
        try:
            if self.kind == "eq":
                return bool(value == self.expected)
            if self.kind == "is":
                return value is self.expected
            if self.kind in ("truthy", "falsy"):
                return bool(value) is (self.kind == "truthy")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
            gap = abs(value - self.expected)
            return bool(gap < self.tolerance if self.strict else gap <= self.tolerance)
        except (RecursionError, ValueError, TypeError, OverflowError):
            return False

    def describe(self) -> str:
        if self.kind == "eq":
            return f"== {clip(repr(self.expected), 300)}"
        if self.kind == "is":
            return f"is {self.expected!r}"
        if self.kind == "close":
            return f"within {self.tolerance!r} of {self.expected!r}"
        return self.kind


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _is_abs_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or len(node.args) != 1 or node.keywords:
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "abs") or (
        isinstance(func, ast.Attribute)
        and func.attr == "fabs"
        and isinstance(func.value, ast.Name)
        and func.value.id == "math"
    )


def _lift(test: ast.expr, line: int, times: int) -> tuple[ast.expr, Site] | None:
    """The expression to report and the site that judges it, for the assert forms we lift."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        left_lit, left_val = _literal(left)
        right_lit, right_val = _literal(right)
        if isinstance(op, ast.Eq) and left_lit != right_lit:
            return (
                (right, Site("eq", left_val, line, times))
                if left_lit
                else (
                    left,
                    Site("eq", right_val, line, times),
                )
            )
        if (
            isinstance(op, ast.Is)
            and right_lit
            and not left_lit
            and right_val in (True, False, None)
            and type(right_val) in (bool, type(None))
        ):
            return left, Site("is", right_val, line, times)
        if isinstance(op, (ast.Lt, ast.LtE)) and right_lit and _is_abs_call(left):
            inner = left.args[0]  # type: ignore[attr-defined]
            tol_ok = isinstance(right_val, (int, float)) and not isinstance(right_val, bool)
            if tol_ok and isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Sub):
                a_lit, a_val = _literal(inner.left)
                b_lit, b_val = _literal(inner.right)
                if a_lit != b_lit:
                    value, other = (inner.right, a_val) if a_lit else (inner.left, b_val)
                    if isinstance(other, (int, float)) and not isinstance(other, bool):
                        site = Site(
                            "close", other, line, times, float(right_val), isinstance(op, ast.Lt)
                        )
                        return value, site
        return None
    if isinstance(test, ast.Call):
        return test, Site("truthy", None, line, times)
    if (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and isinstance(test.operand, ast.Call)
    ):
        return test.operand, Site("falsy", None, line, times)
    return None


_COUNTED_RUNS = 100_000  # a literal loop longer than this leaves its asserts uncounted
_LEAVES_EARLY = (ast.Break, ast.Continue, ast.Return, ast.Yield, ast.YieldFrom, ast.Await)


def _fixed_runs(loop: ast.For) -> int | None:
    """How often `loop` runs its body when its text fixes it (a literal sequence, or `range` of
    int literals, and nothing that leaves the body early); None otherwise."""
    if any(isinstance(node, _LEAVES_EARLY) for node in ast.walk(loop)):
        return None
    source = loop.iter
    runs = None
    if (
        isinstance(source, ast.Call)
        and isinstance(source.func, ast.Name)
        and source.func.id == "range"
        and 1 <= len(source.args) <= 3
        and not source.keywords
    ):
        bounds = [_literal(arg) for arg in source.args]
        if all(ok and type(value) is int for ok, value in bounds):
            try:
                runs = len(range(*(value for _, value in bounds)))
            except (ValueError, OverflowError):
                return None
    else:
        ok, value = _literal(source)
        if ok and isinstance(value, (list, tuple, str, bytes, set, frozenset, dict)):
            runs = len(value)
    return runs if runs is not None and runs <= _COUNTED_RUNS else None


class RewrittenCheck:
    """A humaneval check with its liftable asserts replaced by reports to the judge.

    The new source is spliced from the old one (each lifted assert's text replaced by a report
    call over the same lines), which is much cheaper than rebuilding and compiling a tree.
    """

    def __init__(self, source: str) -> None:
        self.sites: list[Site] = []
        self._edits: list[tuple[ast.stmt, ast.expr]] = []
        self._rewrite(ast.parse(source).body, times=1)
        self._source = self._splice(source) if self._edits else source

    def _rewrite(self, body: list[ast.stmt], times: int) -> None:
        """Lift the asserts of `body`, which runs `times` times when that is fixed (else 0).

        The answer's process holds the reports until they are sent, so it can drop some: a site
        whose number of runs is fixed by the check's text (straight-line code of `check`, and
        loops over literal sequences or ranges) must report exactly that often. Sites under
        conditions (if, while, try, with, other loops) may run any number of times.
        """
        for stmt in body:
            if isinstance(stmt, ast.Assert):
                lifted = _lift(stmt.test, stmt.lineno, times)
                if lifted is not None:
                    self._edits.append((stmt, lifted[0]))
                    self.sites.append(lifted[1])
                continue
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._rewrite(stmt.body, times=1 if stmt.name == "check" else 0)
                continue
            if isinstance(stmt, ast.For) and times:
                runs = _fixed_runs(stmt)
                self._rewrite(stmt.body, times * runs if runs is not None else 0)
                self._rewrite(stmt.orelse, times if runs is not None else 0)
                continue
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list):
                    self._rewrite(inner, times=0)
            for handler in getattr(stmt, "handlers", ()) or ():
                self._rewrite(handler.body, times=0)

    def _splice(self, source: str) -> str:
        data = source.encode("utf-8")  # AST columns count UTF-8 bytes
        starts = [0]
        for line in data.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))

        def offset(line: int, col: int) -> int:
            return starts[line - 1] + col

        parts: list[bytes] = []
        cursor = 0
        for site, (stmt, expr) in enumerate(self._edits):
            begin = offset(stmt.lineno, stmt.col_offset)
            stop = offset(stmt.end_lineno or stmt.lineno, stmt.end_col_offset or 0)
            inner = data[
                offset(expr.lineno, expr.col_offset) : offset(
                    expr.end_lineno or expr.lineno, expr.end_col_offset or 0
                )
            ]
            # Inside the parentheses, newlines keep every later line where it was.
            pad = data[begin:stop].count(b"\n") - inner.count(b"\n")
            call = f"{harness.REPORT_NAME}({site}, (".encode() + inner + b"\n" * pad + b"))"
            parts += [data[cursor:begin], call]
            cursor = stop
        parts.append(data[cursor:])
        return b"".join(parts).decode("utf-8")

    def compiled(self) -> Any:
        return compile(self._source, "<check>", "exec", dont_inherit=True)

    def source(self) -> str:
        return self._source


def rewrite_check(source: str) -> RewrittenCheck | None:
    """The check with its literal expectations moved out, or None if it does not parse."""
    try:
        return RewrittenCheck(source)
    except Exception:  # a check we cannot prepare is judged a runtime error, never a pass
        return None


# --- records -----------------------------------------------------------------------------------


def parse_records(blob: bytes, start: int, count: int) -> tuple[list[dict[str, Any]], bool, bool]:
    """Validate result lines: (records in order from `start`, junk seen, last line complete).

    A line that is not a record of the next expected test ends the parse with `junk` set: the
    answer wrote into the channel, and only hurts itself.
    """
    records: list[dict[str, Any]] = []
    lines = blob.split(b"\n")
    for line in lines[:-1]:
        if start + len(records) >= count:
            break
        item = _record_of(line, start + len(records))
        if item is None:
            return records, True, True
        records.append(item)
    return records, False, lines[-1] == b""


def _record_of(line: bytes, index: int) -> dict[str, Any] | None:
    """The record in `line` if it is one, and of test `index`; None for anything else."""
    item = _loads(line)
    if item is None or type(item.get("index")) is not int or item["index"] != index:
        return None
    return item if type(item.get("status")) is str else None


# A progress frame: what a child sent since its last newline or frame, ended by PROGRESS_END.
_PROGRESS_FRAME = re.compile(rb"[^\n\x00]*\x00")
_TOKEN = re.compile(rb"([^\n\x00]*)([\n\x00])")


def strip_progress(blob: bytes) -> bytes:
    """A child's output with its progress frames taken out: the record lines alone."""
    return _PROGRESS_FRAME.sub(b"", blob) if harness.PROGRESS_END in blob else blob


class Watch:
    """Reads a child's output while it runs and says when the verdict needs no more of it.

    A humaneval test fails at its first report that does not hold, as the check itself would
    have stopped at that assert; under early stop, the first test judged anything but passed
    ends the job. The child's word can only end its own run sooner: every verdict is still
    judged from the complete records afterwards, except that of a test stopped halfway, which
    is `failed_row`.
    """

    def __init__(
        self,
        start: int,
        tests: Sequence[dict[str, str]],
        kind: str,
        profile: str,
        cpu_limit: float,
        checks: Sequence[RewrittenCheck | None],
        early_stop: bool,
    ) -> None:
        self.next_index = start  # the test the child is on
        self.tests, self.kind, self.profile, self.cpu_limit = tests, kind, profile, cpu_limit
        self.checks, self.early_stop = checks, early_stop
        self.failed_row: ResultRow | None = None
        self.stop = False
        self._buffer = bytearray()
        self._junk = False
        # A child sends a frame per PROGRESS_EVERY of its CPU time: one that sends many more, or
        # larger or malformed ones, is flooding the channel and the watch stops reading (the
        # whole output is judged afterwards), so the child cannot make the worker work for it.
        self._frames_per_test = int(2 * cpu_limit / harness.PROGRESS_EVERY) + 8
        self._frames_left = self._frames_per_test

    def feed(self, data: bytes) -> bool:
        """Take the next bytes the child sent; True once it may be stopped."""
        if self.stop or self._junk:
            return self.stop
        self._buffer += data
        end = 0
        for match in _TOKEN.finditer(self._buffer):
            end = match.end()
            if match.group(2) == b"\n":
                self._record(bytes(match.group(1)))
            else:
                self._frame(bytes(match.group(1)))
            if self.stop or self._junk:
                break
        del self._buffer[:end]
        return self.stop

    def _record(self, line: bytes) -> None:
        index = self.next_index
        self.next_index += 1
        self._frames_left = self._frames_per_test
        if not self.early_stop or index >= len(self.tests):
            return
        record = _record_of(line, index)
        if record is None:
            self._junk = True  # judged as such from the whole output afterwards
            return
        if record["status"] != harness.OK:
            return  # the child stops after such a test itself
        check = self.checks[index] if self.checks else None
        row = judge_record(
            record, self.tests[index]["output"], self.kind, self.profile, self.cpu_limit, check
        )
        self.stop = row.verdict != harness.PASSED

    def _frame(self, text: bytes) -> None:
        self._frames_left -= 1
        frame = _loads(text) if len(text) <= harness.PROGRESS_CAP else None
        if frame is None or self._frames_left < 0:
            self._junk = True
            return
        if self.kind != "humaneval" or self.next_index >= len(self.checks):
            return
        check = self.checks[self.next_index]
        if frame.get("index") != self.next_index or check is None:
            return
        wrong = _humaneval_mismatch({"reports": frame.get("reports")}, check)
        if wrong is not None:
            self.failed_row = ResultRow(self.next_index, harness.WRONG_ANSWER, wrong)
            self.stop = True


def _loads(text: bytes) -> dict[str, Any] | None:
    try:
        item = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return item if type(item) is dict else None


def _number(record: dict[str, Any], key: str) -> float:
    value = record.get(key, 0.0)
    return float(value) if type(value) in (int, float) else 0.0


def _text(record: dict[str, Any], key: str) -> str:
    value = record.get(key, "")
    return value if type(value) is str else ""


def judge_record(
    record: dict[str, Any],
    expected: str,
    kind: str,
    profile: str,
    cpu_limit: float,
    check: RewrittenCheck | None = None,
) -> ResultRow:
    """One test's verdict row (index, verdict, actual, error, stderr, time) from its raw record."""
    row = ResultRow(record["index"], harness.RUNTIME_ERROR, time=_number(record, "time"))
    stderr = _text(record, "stderr")
    if stderr:
        row.stderr = clip(stderr, harness.TEXT_CAP)
    stdout = _text(record, "stdout")
    if kind == "stdin":
        row.actual = clip(stdout, harness.TEXT_CAP)
    row.verdict, row.error = _verdict_of(record, stdout, expected, kind, profile, cpu_limit, check)
    if kind == "call" and "value" in record:
        try:
            row.actual = clip(repr(decode_value(record["value"])), harness.TEXT_CAP)
        except (ValueError, TypeError, KeyError, RecursionError, AttributeError):
            row.actual = "<not plain data>"
    return row


def _verdict_of(
    record: dict[str, Any],
    stdout: str,
    expected: str,
    kind: str,
    profile: str,
    cpu_limit: float,
    check: RewrittenCheck | None,
) -> tuple[str, str]:
    """(verdict, error) of one raw record."""
    status = record["status"]
    error = clip(_text(record, "error"), harness.TEXT_CAP)
    if kind == "humaneval" and check is not None:
        wrong = _humaneval_mismatch(record, check)
        if wrong is not None:
            return harness.WRONG_ANSWER, wrong
    if status != harness.OK:
        if status == harness.WALL:
            delay = _number(record, "delay") if "delay" in record else None
            return wall_trip_verdict(
                _number(record, "cpu"), _number(record, "time"), delay, cpu_limit
            )
        verdict = _STATUS_VERDICTS.get(status, harness.RUNTIME_ERROR)
        return verdict, error if verdict == status else "malformed result record"
    if kind == "stdin":
        code = record.get("exit")
        if code is not None and get_profile(profile).exit_status_matters:
            return harness.RUNTIME_ERROR, f"exit code {code}"
        ok = compare_stdout(stdout, expected, profile)
        return (harness.PASSED if ok else harness.WRONG_ANSWER), ""
    if kind == "call":
        return _judge_call(record, expected, profile)
    if check is None:
        return harness.RUNTIME_ERROR, "the check does not compile"
    runs = [0] * len(check.sites)
    for item in record.get("reports", ()):
        if _is_report(item, len(check.sites)):
            runs[item[0]] += 1
    for site, ran in zip(check.sites, runs):
        if site.times and ran != site.times:
            if ran == 0:
                return harness.WRONG_ANSWER, (
                    f"the check ended without running the assert on line {site.line}"
                )
            return harness.WRONG_ANSWER, (
                f"the assert on line {site.line} reported {ran} times, not {site.times}"
            )
    return harness.PASSED, ""


def _is_report(item: Any, sites: int) -> bool:
    return type(item) is list and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < sites


def _humaneval_mismatch(record: dict[str, Any], check: RewrittenCheck) -> str | None:
    reports = record.get("reports", ())
    if type(reports) is not list:
        return "malformed reports"
    for item in reports:
        if not _is_report(item, len(check.sites)):
            return "malformed report"
        site = check.sites[item[0]]
        try:
            value = decode_value(item[1])
        except (ValueError, TypeError, KeyError, RecursionError, AttributeError):
            return f"assert on line {site.line}: the value is not plain data"
        if not site.accepts(value):
            try:
                shown = clip(repr(value), 300)
            except (RecursionError, ValueError):
                shown = "<unprintable>"
            return f"assert on line {site.line} failed: got {shown}, expected {site.describe()}"
    return None


def _judge_call(record: dict[str, Any], expected: str, profile: str) -> tuple[str, str]:
    if "value" not in record:
        return harness.RUNTIME_ERROR, "no value was returned"
    try:
        ok = compare_call(record["value"], expected, profile)
    except ValueError as err:
        if "expected output" in str(err):
            return harness.RUNTIME_ERROR, f"bad test: {err}"
        ok = False
    except (TypeError, KeyError, RecursionError, AttributeError):
        ok = False
    return (harness.PASSED if ok else harness.WRONG_ANSWER), ""


def tests_inputs(tests: Sequence[dict[str, str]]) -> list[str]:
    """What the answer's process may see of a job's tests: their inputs, never the outputs."""
    return [test["input"] for test in tests]
