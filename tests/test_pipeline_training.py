"""Training with the pipelined rollout driver: exact resume (virtual clock), metrics (wall clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars2.search.tree import load_trees
from tests.test_training import _resume_run, compose_run, script_all

pytestmark = pytest.mark.slow
PIPELINED = ("search.config.driver=pipelined", "search.config.clock=virtual")


def test_pipelined_resume_reproduces_the_next_batch(tmp_path: Path, tiny_models_dir: Path) -> None:
    first = tmp_path / "first"
    _resume_run(first, tiny_models_dir, *PIPELINED)
    checkpoint = first / "checkpoints" / "step_000001.ckpt"
    assert checkpoint.exists()
    second = tmp_path / "second"
    _, datamodule = _resume_run(second, tiny_models_dir, *PIPELINED, f"ckpt_path={checkpoint}")
    assert datamodule.last.step == 1
    assert not (second / "trees" / "step_000001_rank0.jsonl").exists()  # step 1 was not redone
    original = load_trees(first / "trees" / "step_000002_rank0.jsonl")
    resumed = load_trees(second / "trees" / "step_000002_rank0.jsonl")
    assert [t.problem.id for t in resumed] == [t.problem.id for t in original]
    for old, new in zip(original, resumed, strict=True):
        # Same answers by the same agents under the same parents: the same tree, node for node.
        assert [(n.parent, n.agent, n.completion) for n in new.answers()] == [
            (n.parent, n.agent, n.completion) for n in old.answers()
        ]
    assert any(n.agent == "tiny_qwen3" for t in resumed for n in t.answers())  # sampled for real


def test_pipelined_wall_clock_step_logs_service_usage(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    from mars2.training.run import build_run

    cfg = compose_run(
        tmp_path,
        tiny_models_dir,
        "steps=1",
        "logger=none",
        "callbacks.checkpoint=null",
        "search.config.driver=pipelined",
    )
    module, datamodule, trainer, sandbox = build_run(cfg)
    script_all(module)
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    data = datamodule.last
    assert all(len(t) == cfg.search.config.max_nodes for t in data.trees)
    metrics = data.metrics
    for agent in ("tiny_qwen3", "tiny_llama"):
        assert 0.0 < metrics[f"{agent}/generator_busy"] <= 1.0
        assert metrics[f"{agent}/generator_idle_seconds"] >= 0.0
    assert 0.0 < metrics["sandbox_busy"] <= 1.0
    assert "generator_busy" in trainer.progress_bar_metrics
