"""`--help` of each console script starts with a usage line, then examples and where the configs
live (Hydra's own help template, filled in by configs/train.yaml and configs/eval.yaml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.parametrize("module", ["train", "eval", "data"])
def test_help_starts_with_usage_and_examples(module: str) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-m", f"mars2.cli.{module}", "--help"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"usage: mars2-{module}"), lines[:3]
    examples = [line for line in lines if line.strip().startswith(f"mars2-{module} ")]
    assert len(examples) >= 3, done.stdout[:2000]
    assert "configs" in done.stdout and "mars2.configs" in done.stdout
