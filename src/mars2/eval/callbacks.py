"""Evaluation during training: held-out pass@1 every few steps and the end-of-run tree views."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from mars2.eval.runner import (
    ResultStore,
    evaluate_sampling,
    evaluate_tree,
    summarise_sampling,
    summarise_tree,
)
from mars2.eval.tree_view import plot_training_overview, write_tree_pages
from mars2.search.runner import SearchConfig
from mars2.search.tree import load_trees
from mars2.training.callback import log_artifact, run_datamodule
from mars2.training.members import team_members
from mars2.utils.atomic import atomic_write_text


def _settle(trainer: pl.Trainer) -> None:
    """With in-flight updates (max_staleness > 0), wait for the rollout in flight: evaluation
    shares the generators and the grader with it."""
    settle = getattr(run_datamodule(trainer), "settle", None)
    if settle is not None:
        settle()


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
    ``heldout/<agent>/pass@1`` and keeps the curve in `history` as (step, agent, pass@1), and the
    pass@1 of each problem group (the problems' ``difficulty``) in `groups` as
    (step, agent, {group: pass@1}).

    With `seed`, every evaluation of an agent draws its samples from the same seeds (per agent
    name and problem chunk): two runs whose agent has the same weights get the same score, so
    methods started from one warm start share their step-0 value exactly and differences between
    evaluations come from the weights, not from sampling luck. Training sampling is unaffected
    (each rollout step seeds its own sampling).

    `start_cache` (with `seed`), a folder: each agent's step-0 result is kept there
    (``heldout_step0_<agent>.json``) and reused by a later run instead of evaluated again. Only
    for runs whose agents all start from the weights that folder belongs to, with the same
    problems, samples, generation and grading settings (the learning suite: one folder per warm
    start, shared by every method).
    """

    def __init__(
        self,
        problems: Any,
        every: int = 5,
        samples: int = 2,
        seed: int | None = None,
        start_cache: str | Path | None = None,
    ) -> None:
        super().__init__()
        if start_cache is not None and seed is None:
            raise ValueError("start_cache needs a seed: unseeded evaluations differ run to run")
        self.problems = list(problems)
        self.every = every
        self.samples = samples
        self.seed = seed
        self.start_cache = None if start_cache is None else Path(start_cache)
        self.history: list[tuple[int, str, float]] = []
        self.groups: list[tuple[int, str, dict[str, float]]] = []
        self.cpu_seconds = 0.0  # this process's CPU time spent evaluating (grading runs elsewhere)

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        began = time.process_time()
        _settle(trainer)
        grader = run_datamodule(trainer).engine.grader
        for name, agent in team_members(pl_module).items():
            cached = None
            if step == 0 and self.start_cache is not None:
                cached = self.start_cache / f"heldout_step0_{name}.json"
            if cached is not None and cached.is_file():
                score, groups = json.loads(cached.read_text())
            else:
                agent.generator.catch_up()
                with tempfile.TemporaryDirectory() as tmp:
                    store = ResultStore(f"{tmp}/heldout.jsonl")
                    evaluate_sampling(self.problems, agent.generator, grader, self.samples, store,
                                      seed=self.seed, stream=f"heldout/{name}")  # fmt: skip
                    summary = summarise_sampling(name, list(store.rows.values()))
                score = summary.metrics["pass@1"]
                groups = {key.removeprefix("difficulty="): value["pass@1"]
                          for key, value in summary.breakdown.items()
                          if key.startswith("difficulty=")}  # fmt: skip
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(cached, json.dumps([score, groups]))
            self.history.append((step, name, score))
            self.groups.append((step, name, groups))
            if trainer.logger:
                trainer.logger.log_metrics({f"heldout/{name}/pass@1": score}, step=step)
        self.cpu_seconds += time.process_time() - began

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluate(trainer, pl_module, 0)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        step = run_datamodule(trainer).last.number  # steps completed so far
        if step % self.every == 0:
            self._evaluate(trainer, pl_module, step)


class TreeEvalCallback(pl.Callback):
    """At the end of training: Pass@1(MCTS) and Pass@N of each agent's own tree and, with several
    agents, of the team's shared tree, on held-out problems at one node budget.

    The search runs on public tests only and every verdict uses all tests (`evaluate_tree`, as
    ``mars2-eval`` does); each setting's trees are seeded from (`seed`, setting), so two runs
    with the same weights grow the same trees. Results land in `results` as
    {"<agent>" | "team": {"pass@1(mcts)": ..., "pass@N": ..., "<group>": {...}}}.
    """

    def __init__(self, problems: Any, config: SearchConfig, seed: int) -> None:
        super().__init__()
        self.problems = list(problems)
        self.config = config
        self.seed = seed
        self.results: dict[str, dict[str, Any]] = {}
        self.cpu_seconds = 0.0  # this process's CPU time spent searching (grading runs elsewhere)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        began = time.process_time()
        _settle(trainer)
        grader = run_datamodule(trainer).engine.grader
        members = team_members(pl_module)
        generators = {}
        for name, agent in members.items():
            agent.generator.catch_up()
            generators[name] = agent.generator
        settings = {name: {name: g} for name, g in generators.items()}
        if len(generators) > 1:
            settings["team"] = dict(generators)
        for label, team in settings.items():
            with tempfile.TemporaryDirectory() as tmp:
                store = ResultStore(f"{tmp}/{label}.jsonl")
                evaluate_tree(self.problems, team, grader, self.config, store, self.seed,
                              stream=f"tree/{label}")  # fmt: skip
                summary = summarise_tree(label, list(store.rows.values()))
            self.results[label] = {
                **summary.metrics,
                **{key.removeprefix("difficulty="): value
                   for key, value in summary.breakdown.items()
                   if key.startswith("difficulty=")},
            }  # fmt: skip
        self.cpu_seconds += time.process_time() - began
