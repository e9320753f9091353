"""Malformed dataset rows among good ones (issue #42): a missing test set, bad JSON, a non-UTF-8
byte. By default the loader stops with an error naming the file, the row and the fix, before any
model work; with ``bad_rows=skip`` the row is left out and counted in the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars2.data.loaders import load_deepcoder, load_livecodebench, load_problems_jsonl
from mars2.data.problem import ProblemFormatError
from mars2.data.toy import toy_problems

REPO = Path(__file__).resolve().parents[1]
GOOD_DEEPCODER = {"prompt": "echo", "label": {"inputs": ["1"], "outputs": ["1"]}}
BAD_LINES: dict[str, bytes] = {
    "missing tests": json.dumps({"prompt": "x", "label": {"inputs": [], "outputs": []}}).encode(),
    "bad JSON": b'{"prompt": "x", "label": ',
    "non-UTF-8 byte": b'{"prompt": "caf\xe9", "label": {"inputs": ["1"], "outputs": ["1"]}}',
}
NAMED = {"missing tests": "no tests", "bad JSON": "invalid JSON", "non-UTF-8 byte": "not UTF-8"}


def _file(tmp_path: Path, bad: bytes, good: list[bytes] | None = None) -> Path:
    """Two good rows, the bad one as row 3, one more good row."""
    good = good or [
        json.dumps({**GOOD_DEEPCODER, "id": f"p{i}"}).encode() for i in range(3)
    ]  # fmt: skip
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join([good[0], good[1], bad, good[2]]) + b"\n")
    return path


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_a_bad_row_names_file_row_and_fix(tmp_path: Path, kind: str) -> None:
    path = _file(tmp_path, BAD_LINES[kind])
    with pytest.raises(ProblemFormatError) as caught:
        load_deepcoder(path)
    message = str(caught.value)
    assert f"{path}:3:" in message and NAMED[kind] in message, message
    assert "bad_rows=skip" in message  # says what to do


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_bad_rows_skip_leaves_the_row_out_and_counts_it(tmp_path: Path, kind: str, caplog) -> None:
    path = _file(tmp_path, BAD_LINES[kind])
    with caplog.at_level("WARNING"):
        problems = load_deepcoder(path, bad_rows="skip")
    assert [p.id for p in problems] == ["p0", "p1", "p2"]
    assert "skipped 1 malformed row(s)" in caplog.text and f"{path}:3:" in caplog.text


def test_native_and_livecodebench_loaders_take_the_same_switch(tmp_path: Path) -> None:
    native = [p.to_json().encode() for p in toy_problems()[:3]]
    path = _file(tmp_path, BAD_LINES["non-UTF-8 byte"], native)
    with pytest.raises(ProblemFormatError, match=r":3: .*not UTF-8"):
        load_problems_jsonl(path)
    assert len(load_problems_jsonl(path, bad_rows="skip")) == 3
    lcb = [
        json.dumps({"question_id": f"q{i}", "question_content": "s",
                    "public_test_cases": json.dumps([{"input": "1", "output": "1"}])}).encode()
        for i in range(3)
    ]  # fmt: skip
    path = _file(tmp_path, b'{"question_id": "q9", "question_content": "s"}', lcb)
    with pytest.raises(ProblemFormatError, match=r":3: field 'public_test_cases': missing"):
        load_livecodebench(path)
    assert len(load_livecodebench(path, bad_rows="skip")) == 3
    with pytest.raises(ValueError, match="use 'error' or 'skip'"):
        load_livecodebench(path, bad_rows="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("run_dir", [False, True], ids=["default-run-dir", "hydra.run.dir"])
def test_training_refuses_a_bad_row_before_models_load(
    tmp_path: Path, tiny_models_dir: Path, run_dir: bool
) -> None:
    """Both with and without hydra.run.dir (the usual Hydra habit, which skips the run-folder
    code): one paragraph on stderr, no traceback, no model loaded."""
    path = _file(tmp_path, BAD_LINES["non-UTF-8 byte"])
    command = [
        sys.executable, str(REPO / "src/mars2/train.py"), "experiment=tiny_pair", "data=deepcoder",
        f"data.train.path={path}", f"paths.log_dir={tmp_path / 'logs'}",
        f"paths.tiny_models_dir={tiny_models_dir}",
    ]  # fmt: skip
    if run_dir:
        command.append(f"hydra.run.dir={tmp_path / 'chosen'}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("Error: data.train"), done.stderr[-3000:]
    assert f"{path}:3:" in errors[0] and "not UTF-8" in errors[0] and "bad_rows=skip" in errors[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert "Loading" not in done.stdout + done.stderr  # refused before any model work
