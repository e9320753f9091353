"""Readers for the dataset formats we train and evaluate on; each returns validated `Problem`s."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import zlib
from collections.abc import Callable, Iterator
from datetime import date, datetime
from pathlib import Path
from typing import Any, Literal

from mars2.data.problem import Problem, ProblemFormatError, TestCase, TestKind

RowParser = Callable[[dict[str, Any], "_RowContext"], Problem]
# What a loader does with a row that cannot become a problem: stop before any model work with an
# error naming the file and line (the default), or leave it out and say how many were left out.
BadRows = Literal["error", "skip"]
log = logging.getLogger(__name__)
# The metadata key holding a loaded problem's file and line ("path:line").
ROW = "row"
# The names of mars2.sandbox.verdict.compare.PROFILE_NAMES (data sits below sandbox, so not imported).
GRADING_PROFILES = ("lenient", "lcb")


def _check_profile(name: str) -> None:
    if name not in GRADING_PROFILES:
        raise ValueError(f"unknown grading profile {name!r}: use one of {list(GRADING_PROFILES)}")


class _RowContext:
    """Where a row came from, so every error names its file, line and field."""

    def __init__(self, source: str, line: int) -> None:
        self.source = source
        self.line = line

    def fail(self, field_name: str, message: str) -> ProblemFormatError:
        return ProblemFormatError(self.source, self.line, field_name, message)

    def require(self, row: dict[str, Any], field_name: str) -> Any:
        if field_name not in row or row[field_name] is None:
            raise self.fail(field_name, "missing")
        return row[field_name]


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for each non-blank line; a line that is not UTF-8, not JSON or
    not an object raises `ProblemFormatError` naming the file and line."""
    for line_no, row in iter_rows(path):
        if isinstance(row, ProblemFormatError):
            raise row
        yield line_no, row


def iter_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | ProblemFormatError]]:
    """Like `iter_jsonl`, but a malformed line is yielded as its error (so it can be skipped)."""
    source = str(path)
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield (
                    line_no,
                    ProblemFormatError(
                        source, line_no, "<row>", f"not UTF-8 text (byte {err.start}: {err.reason})"
                    ),
                )
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield line_no, ProblemFormatError(source, line_no, "<row>", f"invalid JSON: {err}")
                continue
            if not isinstance(row, dict):
                yield (
                    line_no,
                    ProblemFormatError(source, line_no, "<row>", "expected a JSON object"),
                )
                continue
            yield line_no, row


def _check_bad_rows(bad_rows: str) -> None:
    if bad_rows not in ("error", "skip"):
        raise ValueError(f"unknown bad_rows={bad_rows!r}: use 'error' or 'skip'")


def _load(
    path: str | Path, parse: RowParser, limit: int | None, bad_rows: BadRows = "error"
) -> list[Problem]:
    _check_bad_rows(bad_rows)
    problems: list[Problem] = []
    seen: set[str] = set()
    skipped: list[ProblemFormatError] = []
    for line_no, row in iter_rows(path):
        ctx = _RowContext(str(path), line_no)
        try:
            if isinstance(row, ProblemFormatError):
                raise row
            try:
                problem = parse(row, ctx)
            except ProblemFormatError:
                raise
            except (ValueError, TypeError, KeyError) as err:
                raise ctx.fail("<row>", str(err)) from err
            if problem.id in seen:
                raise ctx.fail("id", f"duplicate problem id {problem.id!r}")
        except ProblemFormatError as err:
            if bad_rows == "error":
                err.add_hint(
                    "Fix or delete that row, or set bad_rows=skip on this data source (e.g. "
                    "data.train.bad_rows=skip) to leave malformed rows out and count them."
                )
                raise
            skipped.append(err)
            continue
        seen.add(problem.id)
        problem.metadata[ROW] = f"{path}:{line_no}"  # where later checks point (prompt lengths)
        problems.append(problem)
        if limit is not None and len(problems) >= limit:
            break
    if skipped:
        log.warning(
            "%s: skipped %d malformed row(s) (bad_rows=skip), kept %d; first: %s",
            path,
            len(skipped),
            len(problems),
            skipped[0],
        )
    return problems


# --- mars2's own format ---------------------------------------------------------------------


def load_problems_jsonl(
    path: str | Path, limit: int | None = None, bad_rows: BadRows = "error"
) -> list[Problem]:
    """Read problems written by `save_problems_jsonl` (our native format); `bad_rows` as in
    `_load` (``error``: stop at the first malformed row; ``skip``: leave such rows out, counted)."""

    def parse(row: dict[str, Any], ctx: _RowContext) -> Problem:
        for name in ("id", "statement", "test_kind"):
            ctx.require(row, name)
        try:
            TestKind(row["test_kind"])
        except ValueError as err:
            raise ctx.fail("test_kind", str(err)) from err
        return Problem.from_dict(row)

    return _load(path, parse, limit, bad_rows)


def save_problems_jsonl(problems: list[Problem], path: str | Path) -> None:
    """Write problems in our native jsonl format."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for problem in problems:
            handle.write(problem.to_json() + "\n")


# --- LiveCodeBench ----------------------------------------------------------------------------


def decode_lcb_tests(raw: Any, ctx: _RowContext, field_name: str) -> list[dict[str, Any]]:
    """LiveCodeBench stores tests as a JSON string, or as base64(zlib(pickle(JSON string)))."""
    if isinstance(raw, list):
        return raw
    if not isinstance(raw, str):
        raise ctx.fail(field_name, f"expected a string or list, got {type(raw).__name__}")
    try:
        decoded = json.loads(raw)
    except json.JSONDecodeError:
        try:
            unpacked = pickle.loads(zlib.decompress(base64.b64decode(raw.encode("utf-8"))))
            decoded = json.loads(unpacked) if isinstance(unpacked, str | bytes) else unpacked
        except Exception as err:
            raise ctx.fail(field_name, f"neither JSON nor base64-zlib-pickle: {err}") from err
    if not isinstance(decoded, list):
        raise ctx.fail(field_name, "expected a list of test cases")
    return decoded


def _lcb_cases(
    items: list[dict[str, Any]], ctx: _RowContext, field_name: str
) -> tuple[TestCase, ...]:
    cases = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or "input" not in item or "output" not in item:
            raise ctx.fail(f"{field_name}[{index}]", "each test needs 'input' and 'output'")
        cases.append(TestCase(input=str(item["input"]), output=str(item["output"])))
    return tuple(cases)


def _parse_date(value: Any, ctx: _RowContext, field_name: str) -> date | None:
    if value in (None, ""):
        return None
    try:
        return datetime.fromisoformat(str(value)).date()
    except ValueError as err:
        raise ctx.fail(field_name, f"not an ISO date: {value!r}") from err


def _as_date(value: str | date | None) -> date | None:
    if value is None or isinstance(value, date):
        return value
    text = str(value)
    if len(text) == 7:  # "2025-01" means the first of that month
        text += "-01"
    return date.fromisoformat(text)


def load_livecodebench(
    path: str | Path,
    start_date: str | date | None = None,
    end_date: str | date | None = None,
    limit: int | None = None,
    grading_profile: str = "lcb",
    bad_rows: BadRows = "error",
) -> list[Problem]:
    """Read LiveCodeBench code-generation jsonl, keeping problems with start <= contest_date <= end.

    An end date given as a month ("2025-05") includes that whole month. Problems are graded with
    `grading_profile` (default ``lcb``: LiveCodeBench's own verdicts, see mars2.sandbox.verdict.compare).
    """
    _check_profile(grading_profile)
    start = _as_date(start_date)
    end = _as_date(end_date)
    if isinstance(end_date, str) and len(end_date) == 7 and end is not None:
        next_month = date(end.year + (end.month == 12), end.month % 12 + 1, 1)
        end = date.fromordinal(next_month.toordinal() - 1)

    def parse(row: dict[str, Any], ctx: _RowContext) -> Problem:
        qid = str(ctx.require(row, "question_id"))
        statement = str(ctx.require(row, "question_content"))
        public = _lcb_cases(
            decode_lcb_tests(ctx.require(row, "public_test_cases"), ctx, "public_test_cases"),
            ctx,
            "public_test_cases",
        )
        private = _lcb_cases(
            decode_lcb_tests(row.get("private_test_cases") or "[]", ctx, "private_test_cases"),
            ctx,
            "private_test_cases",
        )
        raw_meta = row.get("metadata") or "{}"
        try:
            meta = json.loads(raw_meta) if isinstance(raw_meta, str) else dict(raw_meta)
        except json.JSONDecodeError as err:
            raise ctx.fail("metadata", f"invalid JSON: {err}") from err
        fn_name = meta.get("func_name")
        contest = _parse_date(row.get("contest_date"), ctx, "contest_date")
        if not public and not private:
            raise ctx.fail("private_test_cases", "problem has no tests")
        return Problem(
            id=qid,
            statement=statement,
            test_kind=TestKind.CALL if fn_name else TestKind.STDIN,
            public_tests=public,
            private_tests=private,
            starter_code=str(row.get("starter_code") or ""),
            fn_name=fn_name,
            metadata={
                "source": "livecodebench",
                "title": row.get("question_title", ""),
                "platform": row.get("platform", ""),
                "difficulty": row.get("difficulty", ""),
                "contest_date": contest.isoformat() if contest else None,
                "grading_profile": grading_profile,
                **_reference(row),
            },
        )

    problems = _load(path, parse, None, bad_rows)
    kept = []
    for problem in problems:
        stamp = problem.metadata.get("contest_date")
        day = date.fromisoformat(stamp) if stamp else None
        if (start or end) and day is None:
            continue
        if start and day and day < start:
            continue
        if end and day and day > end:
            continue
        kept.append(problem)
    return kept[:limit] if limit is not None else kept


# --- DeepCoder / MARTI -------------------------------------------------------------------------


def load_deepcoder(
    path: str | Path,
    num_public: int = 2,
    limit: int | None = None,
    grading_profile: str = "lenient",
    bad_rows: BadRows = "error",
) -> list[Problem]:
    """Read DeepCoder / MARTI-style jsonl: ``prompt`` plus ``label`` = {inputs, outputs, fn_name?}.

    Such rows have no public/private split: the first `num_public` tests are shown as feedback and
    every test counts for the reward. Graded with `grading_profile` (default ``lenient``, whose
    float tolerance suits the mixed sources of training data).
    """
    _check_profile(grading_profile)

    def parse(row: dict[str, Any], ctx: _RowContext) -> Problem:
        prompt = str(ctx.require(row, "prompt"))
        label = ctx.require(row, "label")
        if isinstance(label, str):
            try:
                label = json.loads(label)
            except json.JSONDecodeError as err:
                raise ctx.fail("label", f"invalid JSON: {err}") from err
        if not isinstance(label, dict):
            raise ctx.fail("label", "expected an object with inputs/outputs")
        inputs, outputs = label.get("inputs"), label.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ctx.fail("label", "needs lists 'inputs' and 'outputs'")
        if len(inputs) != len(outputs):
            raise ctx.fail("label", f"{len(inputs)} inputs but {len(outputs)} outputs")
        if not inputs:
            raise ctx.fail("label", "no tests")
        fn_name = label.get("fn_name")
        cases = []
        for args, expected in zip(inputs, outputs, strict=True):
            if fn_name:
                arg_list = args if isinstance(args, list) else [args]
                text_in = "\n".join(json.dumps(a) for a in arg_list)
                cases.append(TestCase(text_in, json.dumps(expected)))
            else:
                cases.append(TestCase(_as_text(args), _as_text(expected)))
        problem_id = str(
            row.get("id") or row.get("problem_id") or f"{Path(ctx.source).stem}-{ctx.line}"
        )
        return Problem(
            id=problem_id,
            statement=prompt,
            test_kind=TestKind.CALL if fn_name else TestKind.STDIN,
            public_tests=tuple(cases[:num_public]),
            private_tests=tuple(cases),
            starter_code=str(row.get("starter_code") or ""),
            fn_name=fn_name,
            metadata={
                "source": "deepcoder",
                "difficulty": row.get("difficulty", ""),
                "grading_profile": grading_profile,
                **_reference(row),
            },
        )

    return _load(path, parse, limit, bad_rows)


def _reference(row: dict[str, Any]) -> dict[str, str]:
    """A row's known-good solution, kept for `generation.backend=reference` (checks the data)."""
    solution = row.get("reference_solution")
    return {"reference_solution": str(solution)} if solution else {}


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)
