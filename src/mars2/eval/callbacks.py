"""Evaluation during training: held-out pass@1 every few steps and the end-of-run tree views."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from mars2.eval.runner import ResultStore, evaluate_sampling, summarise_sampling
from mars2.eval.tree_view import plot_training_overview, write_tree_pages
from mars2.search.tree import load_trees
from mars2.training.callback import log_artifact, run_datamodule
from mars2.training.members import team_members


class TreeViewsCallback(pl.Callback):
    """At the end of training: the overview plot over all saved steps and HTML pages of the last
    step's trees (read from ``<output_dir>/trees``, where `MultiAgentCallback` saves them)."""

    def __init__(self, output_dir: str) -> None:
        super().__init__()
        self.output_dir = Path(output_dir)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        files = sorted((self.output_dir / "trees").glob("step_*_rank0.jsonl"))
        if not files:
            return
        by_step = {int(f.name.split("_")[1]): load_trees(f) for f in files}
        outputs = [plot_training_overview(by_step, self.output_dir / "overview.png")]
        outputs += write_tree_pages(by_step[max(by_step)], self.output_dir / "tree_pages")
        for path in outputs:
            log_artifact(trainer, path, "views")


class HeldOutEvalCallback(pl.Callback):
    """Every `every` steps (and before the first), each agent's pass@1 on held-out problems.

    Uses the agents' own generators (same temperature as training) and the run's grader; logs
    ``heldout/<agent>/pass@1`` and keeps the curve in `history` as (step, agent, pass@1).
    """

    def __init__(self, problems: Any, every: int = 5, samples: int = 2) -> None:
        super().__init__()
        self.problems = list(problems)
        self.every = every
        self.samples = samples
        self.history: list[tuple[int, str, float]] = []

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        grader = run_datamodule(trainer).engine.grader
        for name, agent in team_members(pl_module).items():
            agent.generator.catch_up()
            with tempfile.TemporaryDirectory() as tmp:
                store = ResultStore(f"{tmp}/heldout.jsonl")
                evaluate_sampling(self.problems, agent.generator, grader, self.samples, store)
                score = summarise_sampling(name, list(store.rows.values())).metrics["pass@1"]
            self.history.append((step, name, score))
            if trainer.logger:
                trainer.logger.log_metrics({f"heldout/{name}/pass@1": score}, step=step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluate(trainer, pl_module, 0)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        step = run_datamodule(trainer).last.step + 1  # steps completed so far
        if step % self.every == 0:
            self._evaluate(trainer, pl_module, step)
