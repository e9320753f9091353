"""One step numbering everywhere (issue #45 point 7): step k (1 for the first) is the progress
line's "step k/N", the tree file ``trees/step_<k>``, the label of the nodes it grew, the checkpoint
``step_<k>.ckpt`` (which holds global_step k) and the loggers' x-axis."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from mars2.search.tree import load_trees
from mars2.training.run import build_run

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_tree_file_checkpoint_log_line_and_metrics_of_a_step_agree(
    tmp_path: Path, tiny_models_dir: Path, caplog
) -> None:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "experiment=tiny_pair", "data=toy", "warm_start=null", "steps=2",
                "problems_per_step=1", "search.config.max_nodes=2",
                "search.config.expansions_per_round=2", "sandbox.num_workers=1",
                "callbacks.checkpoint.every_n_train_steps=1", "logger=csv", "~callbacks.views",
                f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}/logs",
                f"paths.tiny_models_dir={tiny_models_dir}",
            ],
        )  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    try:
        with caplog.at_level(logging.INFO, logger="mars2.training.progress"):
            trainer.fit(module, datamodule=datamodule)  # stderr is no terminal: one line a step
    finally:
        sandbox.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(",")[0] for line in lines] == ["step 1/2", "step 2/2"]
    trees = sorted(p.name for p in (tmp_path / "trees").glob("*.jsonl"))
    assert trees == ["step_000001_rank0.jsonl", "step_000002_rank0.jsonl"]
    for number in (1, 2):
        nodes = [n for t in load_trees(tmp_path / "trees" / trees[number - 1]) for n in t.answers()]
        assert nodes and {n.step for n in nodes} == {number}
        saved = torch.load(tmp_path / "checkpoints" / f"step_{number:06d}.ckpt", weights_only=False)
        assert saved["global_step"] == number
    assert datamodule.last is not None and datamodule.last.number == 2
    (metrics,) = (tmp_path / "csv").glob("*/metrics.csv")
    with metrics.open(newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("reward")]
    assert [int(float(r["step"])) for r in rows] == [1, 2]
