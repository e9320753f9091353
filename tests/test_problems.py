"""Problem model and loaders: valid rows load, malformed rows fail naming file, line and field."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest

from mars2.data.humaneval import load_humaneval
from mars2.data.loaders import (
    load_deepcoder,
    load_livecodebench,
    load_problems_jsonl,
    save_problems_jsonl,
)
from mars2.data.problem import Problem, ProblemFormatError, TestKind
from mars2.data.toy import split_problems, toy_problems


def _lcb_row(qid: str, date: str, func: str | None = None, compressed: bool = False) -> dict:
    private = json.dumps([{"input": "3\n", "output": "6\n", "testtype": "stdin"}])
    if compressed:
        private = base64.b64encode(zlib.compress(pickle.dumps(private))).decode()
    return {
        "question_id": qid,
        "question_title": "t",
        "question_content": "Double it.",
        "platform": "atcoder",
        "contest_date": date,
        "difficulty": "easy",
        "starter_code": "",
        "public_test_cases": json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}]),
        "private_test_cases": private,
        "metadata": json.dumps({"func_name": func} if func else {}),
    }


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in rows) + "\n")
    return path


def test_livecodebench_both_private_encodings_and_date_window(tmp_path: Path) -> None:
    rows = [
        _lcb_row("a", "2024-12-31T00:00:00"),
        _lcb_row("b", "2025-01-05T00:00:00", compressed=True),
        _lcb_row("c", "2025-05-31T12:00:00", func="double"),
        _lcb_row("d", "2025-06-01T00:00:00"),
    ]
    path = _write_jsonl(tmp_path / "lcb.jsonl", rows)
    everything = load_livecodebench(path)
    assert [p.id for p in everything] == ["a", "b", "c", "d"]
    window = load_livecodebench(path, start_date="2025-01", end_date="2025-05")
    assert [p.id for p in window] == ["b", "c"]
    b, c = window
    assert b.private_tests[0].output == "6\n"  # decoded from base64/zlib/pickle
    assert b.test_kind is TestKind.STDIN and c.test_kind is TestKind.CALL and c.fn_name == "double"
    assert c.metadata["platform"] == "atcoder" and c.metadata["contest_date"] == "2025-05-31"


@pytest.mark.parametrize(
    ("row", "field"),
    [
        (
            {k: v for k, v in _lcb_row("x", "2025-01-01").items() if k != "question_content"},
            "question_content",
        ),
        (
            {**_lcb_row("x", "2025-01-01"), "private_test_cases": "%%%not-base64%%%"},
            "private_test_cases",
        ),
        ({**_lcb_row("x", "2025-01-01"), "contest_date": "yesterday"}, "contest_date"),
        (
            {**_lcb_row("x", "2025-01-01"), "public_test_cases": json.dumps([{"input": "1"}])},
            "public_test_cases[0]",
        ),
    ],
)
def test_livecodebench_malformed_row_names_file_line_field(
    tmp_path: Path, row: dict, field: str
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [_lcb_row("ok", "2025-01-01"), row])
    with pytest.raises(ProblemFormatError) as info:
        load_livecodebench(path)
    assert info.value.line == 2 and info.value.field_name == field
    assert str(path) in str(info.value)


def test_invalid_json_line_is_reported(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "broken.jsonl", [_lcb_row("ok", "2025-01-01"), "{not json"])
    with pytest.raises(ProblemFormatError, match=r"broken.jsonl:2"):
        load_livecodebench(path)


def test_deepcoder_rows(tmp_path: Path) -> None:
    rows = [
        {
            "prompt": "Add one.",
            "label": json.dumps(
                {"inputs": [[1], [2], [5]], "outputs": [2, 3, 6], "fn_name": "inc"}
            ),
        },
        {"prompt": "Echo.", "label": {"inputs": ["a\n", "b\n"], "outputs": ["a\n", "b\n"]}},
    ]
    problems = load_deepcoder(_write_jsonl(tmp_path / "dc.jsonl", rows), num_public=1)
    inc, echo = problems
    assert (
        inc.test_kind is TestKind.CALL
        and inc.private_tests[2].input == "5"
        and inc.private_tests[2].output == "6"
    )
    assert len(inc.public_tests) == 1 and len(inc.private_tests) == 3
    assert echo.test_kind is TestKind.STDIN and echo.private_tests[1].input == "b\n"


def test_deepcoder_mismatched_tests_fail(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "label": {"inputs": [1, 2], "outputs": [1]}}]
    with pytest.raises(ProblemFormatError, match="label"):
        load_deepcoder(_write_jsonl(tmp_path / "dc.jsonl", rows))


def test_native_round_trip_and_duplicate_ids(tmp_path: Path) -> None:
    problems = toy_problems()[:5]
    path = tmp_path / "p.jsonl"
    save_problems_jsonl(problems, path)
    loaded = load_problems_jsonl(path)
    # Loaders note where each row came from (for the prompt-cap refusal); the rest round-trips.
    assert [p.metadata.pop("row") for p in loaded] == [f"{path}:{i}" for i in range(1, 6)]
    assert loaded == problems
    save_problems_jsonl([problems[0], problems[0]], path)
    with pytest.raises(ProblemFormatError, match="duplicate"):
        load_problems_jsonl(path)


def test_problem_validation() -> None:
    with pytest.raises(ValueError, match="fn_name"):
        Problem("p", "s", TestKind.CALL, (), (toy_problems()[0].private_tests[0],))
    with pytest.raises(ValueError, match="no tests"):
        Problem("p", "s", TestKind.STDIN, (), ())


def test_humaneval_has_164_problems_with_check_tests() -> None:
    problems = load_humaneval()
    assert len(problems) == 164
    assert all(
        p.test_kind is TestKind.HUMANEVAL and "def check" in p.private_tests[0].input
        for p in problems
    )


def test_toy_set_is_large_enough_and_deterministic() -> None:
    problems = toy_problems()
    assert len(problems) >= 60
    kinds = {p.test_kind for p in problems}
    assert kinds == {TestKind.STDIN, TestKind.CALL}
    assert all(p.public_tests and p.private_tests for p in problems)
    assert toy_problems() == problems
    train, held = split_problems(problems)
    assert not {p.id for p in train} & {p.id for p in held} and len(train) + len(held) == len(
        problems
    )
