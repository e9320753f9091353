"""Build everything a training run needs from a composed Hydra config and run it."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from mars2.rewards.routing import AdvantageConfig
from mars2.sandbox.grader import Grader
from mars2.training.agent_module import AgentModule
from mars2.training.datamodule import TreeSearchDataModule
from mars2.training.memory import check_memory
from mars2.training.rollout import ProblemSchedule, RolloutEngine
from mars2.training.team_module import MultiAgentModule
from mars2.training.warm_start import WarmStartConfig, warm_start

log = logging.getLogger(__name__)

# Known and intended: batches are pulled with `dataloader_iter` (no prefetch, so rollouts are
# on-policy) and checkpoints hold the post-step state of manually optimised agents.
for _pattern in (
    ".*dataloader_iter.*",
    ".*pre-optimization state.*",
    ".*isinstance\\(treespec, LeafSpec\\).*",
):
    warnings.filterwarnings("ignore", message=_pattern)


def build_agents(cfg: DictConfig) -> dict[str, AgentModule]:
    """Instantiate every agent under ``cfg.agents``; its key must match its name."""
    if not cfg.get("agents"):
        raise ValueError("no agents configured: pick some with agent=[name,...]")
    agents = {}
    for key, agent_cfg in cfg.agents.items():
        agent = hydra.utils.instantiate(agent_cfg, _convert_="all")
        if agent.name != key:
            raise ValueError(f"agent config {key!r} names itself {agent.name!r}")
        agents[key] = agent
    return agents


def run_warm_start(cfg: DictConfig, agents: dict[str, AgentModule]) -> None:
    """Supervised warm start of every agent on ``data.warm_start`` problems (disjoint from RL)."""
    if not cfg.data.get("warm_start"):
        raise ValueError(
            "warm_start is set but the data config has no warm_start problems (try data=arith)"
        )
    problems = hydra.utils.instantiate(cfg.data.warm_start, _convert_="all")
    settings = WarmStartConfig(**OmegaConf.to_container(cfg.warm_start, resolve=True))  # type: ignore[arg-type]
    for name, agent in agents.items():
        losses = warm_start(agent, problems, settings)
        log.info(
            "warm start of %s on %d problems: loss %.3f -> %.3f",
            name,
            len(problems),
            losses[0],
            losses[-1],
        )


def build_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    return [
        hydra.utils.instantiate(c, _convert_="all")
        for c in (cfg.get("callbacks") or {}).values()
        if c
    ]


def build_logger(cfg: DictConfig) -> Any:
    if not cfg.get("logger"):
        return False
    uri = cfg.logger.get("tracking_uri")
    if uri and str(uri).startswith("sqlite:///"):
        Path(str(uri)[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    return hydra.utils.instantiate(cfg.logger, _convert_="all")


def build_run(cfg: DictConfig) -> tuple[Any, TreeSearchDataModule, pl.Trainer, Any]:
    """(team module, datamodule, trainer, sandbox) for a training config."""
    check_memory(cfg)  # refuses a GPU run that cannot fit, before any model is loaded
    pl.seed_everything(cfg.seed, workers=True)
    agents = build_agents(cfg)
    if cfg.get("warm_start") and not cfg.get("ckpt_path"):  # a checkpoint brings trained weights
        run_warm_start(cfg, agents)
    module: Any = MultiAgentModule(agents)
    sandbox = hydra.utils.instantiate(cfg.sandbox, _convert_="all")
    grader = Grader(sandbox, reward=cfg.grader.reward, early_stop=cfg.grader.early_stop)
    problems = hydra.utils.instantiate(cfg.data.train, _convert_="all")
    search = hydra.utils.instantiate(cfg.search, _convert_="all")
    engine = RolloutEngine(
        ProblemSchedule(problems, cfg.problems_per_step, cfg.seed),
        search,
        grader,
        AdvantageConfig(**OmegaConf.to_container(cfg.advantage, resolve=True)),  # type: ignore[arg-type]
        agent_statistics=search.agent_statistics,
        overlong_penalty=cfg.overlong_penalty,
    )
    datamodule = TreeSearchDataModule(engine, max_steps=cfg.steps)
    logger = build_logger(cfg)
    trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=build_callbacks(cfg), logger=logger, _convert_="all"
    )
    if logger:
        logger.log_hyperparams(_flat_params(cfg))
    return module, datamodule, trainer, sandbox


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the team; returns the last logged metrics."""
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


def _flat_params(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config flattened to dotted keys (MLflow params)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = str(node)[:500]

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat
