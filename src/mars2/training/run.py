"""Build everything a training run needs from a composed Hydra config and run it."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from mars2.builders import (
    build_agents,
    build_callbacks,
    build_grader,
    build_logger,
    build_problems,
    build_sandbox,
    flat_params,
)
from mars2.training.agent_module import AgentModule
from mars2.training.datamodule import TreeSearchDataModule
from mars2.training.memory import check_memory
from mars2.training.progress import warm_start_bar
from mars2.training.rollout import RolloutEngine
from mars2.training.team_module import MultiAgentModule
from mars2.training.warm_start import WarmStartConfig, warm_start
from mars2.utils.logs import one_line_per_message
from mars2.utils.runs import resolve_checkpoint
from mars2.utils.validation import validate_train_config

log = logging.getLogger(__name__)

# Known and intended: batches are pulled with `dataloader_iter` (no prefetch, so rollouts are
# on-policy) and checkpoints hold the post-step state of manually optimised agents.
for _pattern in (
    ".*dataloader_iter.*",
    ".*pre-optimization state.*",
    ".*isinstance\\(treespec, LeafSpec\\).*",
):
    warnings.filterwarnings("ignore", message=_pattern)


def run_warm_start(cfg: DictConfig, agents: dict[str, AgentModule]) -> None:
    """Supervised warm start of every agent on ``data.warm_start`` problems (disjoint from RL)."""
    if not cfg.data.get("warm_start"):
        raise ValueError(
            "warm_start is set but the data config has no warm_start problems (try data=arith)"
        )
    problems = build_problems(cfg, "warm_start")
    settings = WarmStartConfig(**OmegaConf.to_container(cfg.warm_start, resolve=True))  # type: ignore[arg-type]
    for name, agent in agents.items():
        with warm_start_bar(name, settings.epochs) as on_epoch:
            losses = warm_start(agent, problems, settings, on_epoch=on_epoch)
        log.info(
            "warm start of %s on %d problems: loss %.3f -> %.3f",
            name,
            len(problems),
            losses[0],
            losses[-1],
        )


def warm_start_needed(cfg: DictConfig) -> bool:
    """Whether the run warms its agents up first: a fresh run with ``warm_start`` set, or a resumed
    one whose KL reference (full fine-tuning with β > 0, never checkpointed) is the warm-started
    policy; the seeded warm start rebuilds it and the checkpoint then brings the trained policy."""
    if not cfg.get("warm_start"):
        return False
    if not cfg.get("ckpt_path"):
        return True
    return any(
        float(agent.loss.get("beta", 0.0)) > 0 and agent.model.get("lora") is None
        for agent in cfg.agents.values()
    )


def build_rollout(cfg: DictConfig, grader: Any) -> RolloutEngine:
    """The rollout engine of ``cfg.rollout``: its schedule over ``data.train``, the search, the
    grader and the advantage settings."""
    # Built objects go in as call arguments of the partials, never through Hydra's merge (which
    # would turn dataclasses such as Problem into configs).
    spec: Any = OmegaConf.to_container(cfg.rollout, resolve=True)
    make_schedule = hydra.utils.instantiate(spec.pop("schedule"), _partial_=True)
    search = hydra.utils.instantiate(cfg.search, _convert_="all")
    make_engine = hydra.utils.instantiate(spec, _partial_=True)
    engine: RolloutEngine = make_engine(
        schedule=make_schedule(problems=build_problems(cfg, "train")),
        search=search,
        grader=grader,
        advantages=hydra.utils.instantiate(cfg.advantage),
        agent_statistics=search.agent_statistics,
    )
    return engine


def build_run(cfg: DictConfig) -> tuple[Any, TreeSearchDataModule, pl.Trainer, Any]:
    """(team module, datamodule, trainer, sandbox) for a training config."""
    pl.seed_everything(cfg.seed, workers=True)
    agents = build_agents(cfg)
    if warm_start_needed(cfg):
        run_warm_start(cfg, agents)
    module: Any = MultiAgentModule(agents)
    sandbox = build_sandbox(cfg)
    datamodule = TreeSearchDataModule(build_rollout(cfg, build_grader(cfg, sandbox)), cfg.steps)
    logger = build_logger(cfg)
    trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=build_callbacks(cfg), logger=logger, _convert_="all"
    )
    if logger:
        logger.log_hyperparams(flat_params(cfg))
    return module, datamodule, trainer, sandbox


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the team; returns the last logged metrics."""
    one_line_per_message()
    check_memory(cfg)  # refuses a GPU run that cannot fit, before anything is loaded
    validate_train_config(cfg)  # before any model loads
    cfg.ckpt_path = resolve_checkpoint(cfg)  # resume=true: the run folder's newest checkpoint
    module, datamodule, trainer, sandbox = build_run(cfg)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    finally:
        sandbox.close()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    log.info(
        "finished at step %d: %s",
        trainer.global_step,
        {k: round(v, 4) for k, v in metrics.items() if "/" not in k},
    )
    return metrics
