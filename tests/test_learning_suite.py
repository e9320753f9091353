"""scripts/learning_curve.py's summary: the issue's shape, and intervals from known per-seed runs.

The runs are synthetic (no training): the summary is pure arithmetic over their curves and trees.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "learning_curve.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("learning_curve", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["learning_curve"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["learning_curve"]


def _run(method, seed: int, lift: float) -> dict:
    """Step 0 at 0.2 + 0.01 x seed, then `lift` more at steps 24-40 (steps 8 and 16 in between)."""
    members = {member: base for member, base in method.members}
    start = 0.2 + 0.01 * seed
    curve = {"0": start, "8": start, "16": start, "24": start + lift, "32": start + lift,
             "40": start + lift}  # fmt: skip
    groups = {st: {"add": v, "mul": v / 2, "composition": 0.0} for st, v in curve.items()}
    trees = {m: {"pass@1(mcts)": 0.3, "pass@N": 0.4} for m in members}
    if method.is_team:
        trees["team"] = {"pass@1(mcts)": 0.5 + 0.01 * seed, "pass@N": 0.6}
    return {"method": method.name, "seed": seed, "members": members,
            "curve": {m: curve for m in members}, "groups": {m: groups for m in members},
            "trees": trees}  # fmt: skip


def test_summary_has_the_issues_shape_and_known_intervals(suite) -> None:
    seeds = [0, 1, 2]
    lift = {m.name: (0.1 if m.is_team else 0.05) + 0.01 * i for i, m in enumerate(suite.METHODS)}
    results = [_run(m, s, lift[m.name] + 0.01 * s) for m in suite.METHODS for s in seeds]
    summary = suite.summarise(results, list(suite.METHODS))
    details = {key: summary.pop(key) for key in ("trees", "groups")}
    assert set(summary) == {"methods", "paired"}
    names = set(summary["methods"])
    assert {f"vanilla GRPO ({a})" for a in ("tiny_qwen3", "tiny_llama")} <= names
    teams = [m.name for m in suite.METHODS if m.is_team]
    assert len(teams) == 5 and all("pair" in name for name in teams)
    for agents in summary["methods"].values():
        for entry in agents.values():
            assert set(entry) == {"gain_mean", "gain_ci95", "final_mean", "final_ci95"}
    for entry in summary["paired"].values():
        assert set(entry) == {"diff_mean", "diff_ci95"}

    # Gains lift + 0.01 x seed over seeds 0, 1, 2: mean lift + 0.01, sd 0.01, t(0.95, 2) = 4.3027.
    half = 4.302653 * 0.01 / math.sqrt(3)
    grpo = summary["methods"]["vanilla GRPO (tiny_qwen3)"]["tiny_qwen3"]
    assert grpo["gain_mean"] == pytest.approx(0.06)
    assert grpo["gain_ci95"] == pytest.approx([0.06 - half, 0.06 + half])
    # Final = step 0 + gain = 0.2 + 0.02 x seed (+ lift): sd 0.02.
    assert grpo["final_ci95"] == pytest.approx([0.26 + 0.01 - 2 * half, 0.27 + 2 * half])
    # Paired: the pair's tiny_qwen3 minus GRPO alone differs by the same amount in every seed.
    pair = "MARS2 pair (tiny_qwen3 + tiny_llama)"
    diff = summary["paired"][f"{pair} [tiny_qwen3] - vanilla GRPO (tiny_qwen3): held-out pass@1"]
    expected = lift[pair] - lift["vanilla GRPO (tiny_qwen3)"]
    assert diff["diff_mean"] == pytest.approx(expected)
    assert diff["diff_ci95"] == pytest.approx([expected, expected])
    tree = summary["paired"][f"{pair} team tree - single-agent tree (tiny_llama) own tree: pass@N"]
    assert tree["diff_mean"] == pytest.approx(0.2)
    inside = summary["paired"][f"{pair} team tree - its [tiny_llama] own tree: pass@1(mcts)"]
    assert inside["diff_mean"] == pytest.approx(0.21)
    assert details["trees"][pair]["team"]["pass@1(mcts)_mean"] == pytest.approx(0.51)
    mul = details["groups"][pair]["tiny_llama"]["mul"]
    assert mul["mean_start"] == pytest.approx(0.105)
    assert mul["mean_final"] == pytest.approx(0.105 + (lift[pair] + 0.01) / 2)


def test_plot_and_tables_come_out(suite, tmp_path, capsys) -> None:
    results = [_run(m, s, 0.05) for m in suite.METHODS for s in (0, 1)]
    summary = suite.summarise(results, list(suite.METHODS))
    suite.plot(results, list(suite.METHODS), tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    suite.print_tables(summary)
    out = capsys.readouterr().out
    assert "| vanilla GRPO (tiny_llama) | tiny_llama | +0.255 [" in out
    assert "| MARS2 pair (tiny_qwen3 + tiny_llama) | team | +0.505 [" in out
