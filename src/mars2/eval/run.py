"""`mars2-eval ...`: every agent alone and the team, Pass@k and tree-search metrics."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from mars2 import builders
from mars2.eval.report import log_to_mlflow, table, write_reports
from mars2.eval.runner import Summary, evaluate_settings
from mars2.eval.tree_view import write_tree_pages
from mars2.generation.engines import EnginePool
from mars2.generation.factory import build_generators
from mars2.search.runner import SearchConfig
from mars2.search.tree import load_trees
from mars2.training.members import team_members
from mars2.training.team_module import MultiAgentModule
from mars2.utils.logs import one_line_per_message
from mars2.utils.tracking import tracked
from mars2.utils.validation import validate_eval_config

log = logging.getLogger(__name__)


def load_team(cfg: DictConfig) -> MultiAgentModule:
    """The configured agents, with trained weights from `ckpt_path` when given."""
    team = MultiAgentModule(builders.build_agents(cfg))
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
    chunk: int | None = 32,
) -> list[Summary]:
    """Every agent alone (Pass@k, single-agent tree) and the whole team (shared tree)."""
    return evaluate_settings(problems, generators, grader, search_config, samples, out, seed, chunk)


def evaluate(cfg: DictConfig) -> list[Summary]:
    """Validate, build, run, report. Rerunning into the same output dir (`resume=true` or the
    same `hydra.run.dir`) keeps what is finished and redoes the rest exactly."""
    one_line_per_message()
    validate_eval_config(cfg)
    out = Path(cfg.paths.output_dir)
    problems = builders.build_problems(cfg, "eval", cfg.eval.limit)
    logger = builders.build_logger(cfg)
    if logger:
        logger.log_hyperparams(builders.flat_params(cfg))
    with tracked(logger):
        summaries = _evaluate(cfg, problems, out)
        print(table(summaries))
        files = write_reports(summaries, out)
        team_trees = sorted((out / "trees" / "team").glob("*.jsonl")) or sorted(
            (out / "trees").glob("*/*.jsonl")
        )
        pages = write_tree_pages(
            [t for path in team_trees[:8] for t in load_trees(path)], out / "tree_pages"
        )
        if logger:
            log_to_mlflow(summaries, logger, [*files.values(), *pages])
    return summaries


def _evaluate(cfg: DictConfig, problems: list[Any], out: Path) -> list[Summary]:
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
    sandbox = builders.build_sandbox(cfg)
    try:
        # Metric verdicts on all tests; evaluate_tree gives the search only the public view.
        grader = builders.build_grader(cfg, sandbox, reward_tests="all")
        return run_evaluation(
            problems, generators, grader, search_config, cfg.eval.samples, out, cfg.seed,
            cfg.eval.get("chunk"),
        )  # fmt: skip
    finally:
        sandbox.close()
        pool.close()
