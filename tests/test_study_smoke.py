"""One-seed smoke of `mars2-study run` + `report` on a two-arm tiny study (real warm starts,
training, sampling and a team tree on CPU; about a minute on a quiet machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "tests" / "data" / "study_smoke.yaml"


@pytest.mark.slow  # real runs: ~60 s on 2 idle cores (the CI budget allows this one)
def test_mars2_study_runs_and_reports_one_seed(tmp_path: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "mars2.study.cli"]
    common = [str(STUDY), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    run = subprocess.run([*command, "run", *common, "--jobs", "2", "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "out" / "runs.jsonl").read_text().splitlines()]
    errors = {r["id"]: r["error"] for r in runs if r["error"]}
    assert not errors, errors
    kinds = sorted(r["kind"] for r in runs)
    assert kinds.count("train") == 3 and kinds.count("tree") == 1 and kinds.count("warm") == 2
    train = next(r for r in runs if r["id"].startswith("train/P/"))
    step = train["result"]["steps"][0]["agents"]
    assert set(step) == {"tiny_qwen3", "tiny_llama"}
    assert sum(sum(a["nodes"].values()) for a in step.values()) == 2 * 2  # problems x nodes
    report = subprocess.run([*command, "report", *common], env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["seeds"] == [7] and summary["failed_runs"] == []
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Study `smoke`")
    assert (tmp_path / "out" / "study.png").stat().st_size > 10_000
    again = subprocess.run([*command, "analyse", *common], env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
