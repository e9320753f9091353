"""`python src/mars2/eval.py ...`: every agent alone and the team, Pass@k and tree-search metrics."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from mars2.eval.report import log_to_mlflow, table, write_reports
from mars2.eval.runner import (
    ResultStore,
    Summary,
    evaluate_sampling,
    evaluate_tree,
    summarise_sampling,
    summarise_tree,
)
from mars2.eval.tree_view import write_tree_pages
from mars2.generation.engines import EnginePool
from mars2.generation.factory import build_generators
from mars2.sandbox.grader import Grader
from mars2.search.runner import SearchConfig
from mars2.search.tree import load_trees
from mars2.training.agent_module import team_members
from mars2.training.run import build_agents, build_logger
from mars2.training.team_module import MultiAgentModule

log = logging.getLogger(__name__)


def load_team(cfg: DictConfig) -> MultiAgentModule:
    """The configured agents, with trained weights from `ckpt_path` when given."""
    team = MultiAgentModule(build_agents(cfg))
    if cfg.get("ckpt_path"):
        state = torch.load(cfg.ckpt_path, map_location="cpu", weights_only=False)["state_dict"]
        missing, unexpected = team.load_state_dict(state, strict=False)
        if unexpected or any(k.startswith("agents.") for k in missing):
            raise ValueError(f"checkpoint {cfg.ckpt_path} does not match the configured agents: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")  # fmt: skip
        log.info("loaded trained agents from %s", cfg.ckpt_path)
    team.eval()
    return team


def eval_generators(
    team: MultiAgentModule, temperature: float, pool: EnginePool | None = None
) -> dict[str, Any]:
    """Every agent's generator at the eval temperature, serving the team's current weights."""
    return dict(build_generators(team_members(team), pool, temperature))


def run_evaluation(
    problems: list[Any],
    generators: dict[str, Any],
    grader: Any,
    search_config: SearchConfig,
    samples: int,
    out: Path,
    seed: int,
) -> list[Summary]:
    """Every agent alone (Pass@k, single-agent tree) and the whole team (shared tree)."""
    summaries = []
    for name, generator in generators.items():
        store = ResultStore(out / "results" / f"{name}_sampling.jsonl")
        evaluate_sampling(problems, generator, grader, samples, store)
        summaries.append(summarise_sampling(f"{name}", list(store.rows.values())))
        store = ResultStore(out / "results" / f"{name}_tree.jsonl")
        evaluate_tree(
            problems, {name: generator}, grader, search_config, store, seed, out / "trees" / name
        )
        summaries.append(summarise_tree(f"{name}+tree", list(store.rows.values())))
    if len(generators) > 1:
        store = ResultStore(out / "results" / "team_tree.jsonl")
        evaluate_tree(
            problems, generators, grader, search_config, store, seed, out / "trees" / "team"
        )
        summaries.append(summarise_tree("team+tree", list(store.rows.values())))
    return summaries


def evaluate(cfg: DictConfig) -> list[Summary]:
    """Build, run, report. Rerunning into the same output dir skips problems already graded."""
    out = Path(cfg.paths.output_dir)
    problems = hydra.utils.instantiate(cfg.data.eval, _convert_="all")
    if cfg.eval.limit:
        problems = problems[: cfg.eval.limit]
    team = load_team(cfg)
    pool = EnginePool()  # the vLLM engines of this evaluation, closed at the end
    generators = eval_generators(team, cfg.eval.temperature, pool)
    base: SearchConfig = hydra.utils.instantiate(cfg.search.config, _convert_="all")
    search_config = SearchConfig(
        mode="tree",
        max_nodes=cfg.eval.tree_budget,
        expansions_per_round=base.expansions_per_round,
        policy=base.policy,
    )
    sandbox = hydra.utils.instantiate(cfg.sandbox, _convert_="all")
    try:
        grader = Grader(sandbox, reward=cfg.grader.reward)
        summaries = run_evaluation(
            problems, generators, grader, search_config, cfg.eval.samples, out, cfg.seed
        )
    finally:
        sandbox.close()
        pool.close()
    print(table(summaries))
    files = write_reports(summaries, out)
    team_trees = sorted((out / "trees" / "team").glob("*.jsonl")) or sorted(
        (out / "trees").glob("*/*.jsonl")
    )
    pages = write_tree_pages(
        [t for path in team_trees[:1] for t in load_trees(path)][:8], out / "tree_pages"
    )
    logger = build_logger(cfg)
    if logger:
        log_to_mlflow(summaries, logger, [*files.values(), *pages])
    return summaries
