"""scripts/learning_curve.py is a three-line alias of `mars2-study` (docs/study.md): its old
options map onto the study's, and the README's command line still parses."""

from __future__ import annotations

from pathlib import Path

from mars2.study.cli import legacy_arguments

REPO = Path(__file__).resolve().parents[1]


def test_the_script_is_a_three_line_alias() -> None:
    lines = (REPO / "scripts" / "learning_curve.py").read_text().splitlines()
    assert len(lines) <= 3
    assert "legacy_main" in lines[-1]


def test_old_options_map_onto_the_study() -> None:
    args = legacy_arguments(["--seeds", "3", "--seed", "100", "--out", "x"])
    assert args[0].endswith("configs/study/team_vs_alone.yaml")
    assert args[args.index("--seeds") + 1 :] == ["100", "101", "102"]
    assert args[args.index("--out") + 1] == "x"
    # The README's command: --seeds 5 from seed 0.
    args = legacy_arguments(["--seeds", "5"])
    assert args[args.index("--seeds") + 1 :] == ["0", "1", "2", "3", "4"]
    # No options: the study file's own seeds (no --seeds passed on).
    assert "--seeds" not in legacy_arguments([])
