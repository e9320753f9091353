"""The CI subset of the chaos suite (issue #42): the cheap faults of benchmarks/chaos.py, two
trials each, at seeded random points (about 1-2 minutes on 2 cores: marked slow so it can be
found; the full table is `make chaos`). Disk full needs root (a size-limited tmpfs) and is skipped
with its reason otherwise; E2B runs against a local fake SDK (the service cannot be reached)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("chaos", REPO / "benchmarks" / "chaos.py")
assert spec is not None and spec.loader is not None
chaos = importlib.util.module_from_spec(spec)
sys.modules["chaos"] = chaos  # its dataclasses look their module up
spec.loader.exec_module(chaos)

CHEAP = [f for f in chaos.faults() if f.cheap]


@pytest.mark.slow
@pytest.mark.parametrize("fault", CHEAP, ids=[f.run.__name__ for f in CHEAP])
def test_chaos_subset(fault, tmp_path: Path) -> None:
    if fault.skip:
        pytest.skip(fault.skip)
    rng = random.Random(0)
    for index in range(1 if fault.max_trials else 2):
        folder = tmp_path / str(index)
        folder.mkdir()
        trial = fault.run(rng, folder)
        assert trial.survived and trial.lost == 0 and trial.duplicated == 0, trial


def test_a_rerun_with_only_replaces_only_its_rows(tmp_path: Path) -> None:
    import argparse

    out = tmp_path / "reliability.md"
    old = [chaos.Fault(name, "what", chaos.trainer_kill9, trials=[chaos.Trial(True, note=name)])
           for name in ("alpha", "beta")]  # fmt: skip
    full = argparse.Namespace(seed=0, trials=10, trainer_trials=1, only=None)
    out.write_text(
        "# Reliability\n\nabove\n\n<!-- chaos table: begin -->\n<!-- chaos table: end -->\n\nbelow\n"
    )
    chaos.write_table(out, chaos.table(old), 5.0, full)
    again = [chaos.Fault("beta", "what", chaos.trainer_kill9,
                         trials=[chaos.Trial(True, exact=True, note="new")] * 3)]  # fmt: skip
    rerun = argparse.Namespace(seed=1, trials=10, trainer_trials=3, only=["trainer_kill9"])
    chaos.write_table(out, chaos.table(again), 7.0, rerun)
    chaos.write_table(out, chaos.table(again), 7.0, rerun)  # twice: one caption line, not two
    text = out.read_text()
    assert text.startswith("# Reliability\n\nabove\n") and text.endswith("\n\nbelow\n")
    rows = [line for line in text.splitlines() if line.startswith(("| alpha", "| beta"))]
    assert rows[0].startswith("| alpha | what | 1 | 1 |") and rows[0].endswith("| alpha |")
    assert rows[1].startswith("| beta | what | 3 | 3 |") and rows[1].endswith("| new |")
    assert text.count("_Written by") == 1 and text.count("rerun alone (`--only`, seed 1") == 1
    added = [chaos.Fault("gamma", "what", chaos.trainer_kill9, trials=[chaos.Trial(True)])]
    chaos.write_table(out, chaos.table(added), 1.0, argparse.Namespace(
        seed=2, trials=10, trainer_trials=1, only=["gamma"]))  # fmt: skip
    text = out.read_text()  # a fault new to the table gets its row; the other captions stay
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")][1:] == [
        "| alpha", "| beta", "| gamma"]  # fmt: skip
    assert "rerun alone (`--only`, seed 1" in text and "_Rows of gamma rerun alone" in text
