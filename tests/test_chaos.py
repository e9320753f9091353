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
