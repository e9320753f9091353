"""`mars2-data`: the conversion from the official dataset formats to the files the loaders read.

The download itself needs the Hugging Face hub, which cannot be reached here: the tests build
rows in the official formats (as the loader tests do) and check the command's refusal offline.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from mars2.data.fetch import FetchError, lcb_files, write_deepcoder, write_livecodebench
from mars2.data.loaders import load_livecodebench
from mars2.sandbox.verdict.grader import Grader


def _lcb_row(qid: str, date: str, platform: str, difficulty: str, func: str | None = None) -> dict:
    """A row of livecodebench/code_generation_lite: tests as JSON strings, the private ones
    base64(zlib(pickle(json))), metadata a JSON string with func_name for LeetCode."""
    kind = "functional" if func else "stdin"
    test = {"input": "3" if func else "3\n", "output": "6" if func else "6\n", "testtype": kind}
    private = base64.b64encode(zlib.compress(pickle.dumps(json.dumps([test])))).decode()
    return {
        "question_title": f"title {qid}", "question_content": f"Double it ({qid}).",
        "platform": platform, "question_id": qid, "contest_id": "c1", "contest_date": date,
        "starter_code": "class Solution:\n    def double(self, x: int) -> int:\n        " if func else "",
        "difficulty": difficulty, "public_test_cases": json.dumps([test]),
        "private_test_cases": private, "metadata": json.dumps({"func_name": func} if func else {}),
    }  # fmt: skip


def test_release_files_are_cumulative() -> None:
    assert lcb_files("v1") == ["test.jsonl"]
    assert lcb_files("release_v6") == [
        "test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"
    ]  # fmt: skip
    with pytest.raises(FetchError, match=r"v1 \.\.\. v6"):
        lcb_files("v9")


def test_livecodebench_release_file_is_read_by_the_loader(tmp_path: Path) -> None:
    first, second = tmp_path / "test.jsonl", tmp_path / "test2.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in (
        _lcb_row("a", "2024-12-30T00:00:00", "atcoder", "easy"),
        _lcb_row("b", "2025-01-04T00:00:00", "leetcode", "medium", func="double"),
    )) + "\n")  # fmt: skip
    second.write_text("\n".join(json.dumps(r) for r in (
        _lcb_row("c", "2025-03-02T00:00:00", "codeforces", "hard"),
        _lcb_row("a", "2024-12-30T00:00:00", "atcoder", "easy"),  # listed again: kept once
    )) + "\n")  # fmt: skip
    target = tmp_path / "data" / "livecodebench" / "release_v2.jsonl"
    written = write_livecodebench([first, second], target)
    assert [json.loads(line)["question_id"] for line in target.read_text().splitlines()] == [
        "a", "b", "c",
    ]  # fmt: skip
    summary = written.summary()
    assert "wrote 3 problems" in summary
    assert "atcoder 1, codeforces 1, leetcode 1" in summary
    assert "easy 1, hard 1, medium 1" in summary
    assert "contest dates: 2024-12-30 to 2025-03-02" in summary
    window = load_livecodebench(target, start_date="2025-01", end_date="2025-05")
    assert [p.id for p in window] == ["b", "c"]  # the v6-style window reads across files
    assert window[0].fn_name == "double" and window[0].private_tests[0].output == "6"


def _deepcoder_rows() -> dict[str, list[dict]]:
    """One row per DeepCoder subset format (agentica-org/DeepCoder-Preview-Dataset)."""
    stdin = "Read n and print 2n."
    call = "Write double(x) returning 2x."
    return {
        "taco": [
            {"problem": stdin, "tests": json.dumps({"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]})},
            {"problem": call, "tests": json.dumps(
                {"fn_name": "double", "inputs": [[3], [5]], "outputs": [[6], [10]]})},
        ],
        "primeintellect": [
            {"problem": stdin, "tests": json.dumps([{"type": "stdin_stdout", "input": "3\n", "output": "6\n"}])},
            {"problem": call, "tests": json.dumps(
                [{"type": "function_call", "fn_name": "double", "input": [4], "output": [8]}])},
        ],
        "lcbv5": [
            {"problem": call, "starter_code": "class Solution:\n    def double(self, x: int) -> int:\n",
             "metadata": json.dumps({"func_name": "double"}),
             "tests": json.dumps([{"input": "7", "output": "14", "testtype": "functional"}])},
        ],
        "codeforces": [
            {"problem": stdin, "tests": json.dumps([{"input": "9\n", "output": "18\n"}])},
            {"problem": stdin, "tests": "[]"},  # no tests: skipped and reported
        ],
    }  # fmt: skip


def test_deepcoder_rows_convert_and_grade_like_their_checkers(tmp_path: Path, sandbox) -> None:
    written = write_deepcoder(_deepcoder_rows(), tmp_path / "deepcoder" / "train.jsonl")
    problems = written.problems
    assert [p.id for p in problems] == [
        "deepcoder/taco/0", "deepcoder/taco/1", "deepcoder/primeintellect/0",
        "deepcoder/primeintellect/1", "deepcoder/lcbv5/0", "deepcoder/codeforces/0",
    ]  # fmt: skip
    assert written.skipped and written.skipped[0].startswith("codeforces/1")
    assert "skipped 1 rows" in written.summary()
    right = {None: "print(2 * int(input()))", "double": "def double(x):\n    return 2 * x\n"}
    wrong = {None: "print(2 * int(input()) + 1)", "double": "def double(x):\n    return [2 * x]\n"}
    grader = Grader(sandbox)
    good = grader.grade_code([(p, right[p.fn_name]) for p in problems])
    bad = grader.grade_code([(p, wrong[p.fn_name]) for p in problems])
    assert all(g.private_passed for g in good)
    assert not any(g.private_passed for g in bad)  # a wrapped [2x] is not the expected 2x


def test_mars2_data_refuses_clearly_without_network(tmp_path: Path) -> None:
    """No hub here (and HF_HUB_OFFLINE=1): the command must say so in one paragraph at once."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for dataset in ("livecodebench", "deepcoder"):
        result = subprocess.run(
            [sys.executable, "-m", "mars2.cli.data", "--data-dir", str(tmp_path), dataset],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert "needs network access" in result.stderr
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_data_dir_goes_before_or_after_the_dataset() -> None:
    from mars2.cli.data import _parser

    parser = _parser()
    for argv in (["--data-dir", "d", "livecodebench"], ["livecodebench", "--data-dir", "d"],
                 ["deepcoder", "--split", "test", "--data-dir", "d"]):  # fmt: skip
        assert parser.parse_args(argv).data_dir == Path("d"), argv
    assert parser.parse_args(["livecodebench"]).data_dir is None
