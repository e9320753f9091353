"""Objects a training or an evaluation run builds from its composed Hydra config.

Shared by `mars2.training.run` and `mars2.eval.run`; it sits below both and imports neither.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from mars2.utils.validation import load_problem_set

# What an agent with ``trainable: false`` is built as, whatever its `_target_` (named here, not
# imported: builders sit below training).
FROZEN_AGENT = "mars2.training.teammate.FrozenAgent"


def build_agents(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate every agent under ``cfg.agents``; its key must match its name. An agent with
    ``trainable: false`` is built as a frozen teammate (`mars2.training.teammate.FrozenAgent`)."""
    if not cfg.get("agents"):
        raise ValueError("no agents configured: pick some with agent=[name,...]")
    agents = {}
    for key, agent_cfg in cfg.agents.items():
        trainable = agent_cfg.get("trainable", True)
        if not isinstance(trainable, bool):
            raise ValueError(f"agents.{key}.trainable={trainable!r}: use true or false")
        spec = copy.copy(agent_cfg)  # under the same parent: its interpolations still resolve
        with open_dict(spec):
            spec.pop("trainable", None)
            if not trainable:
                spec["_target_"] = FROZEN_AGENT
        agent = hydra.utils.instantiate(spec, _convert_="all")
        if agent.name != key:
            raise ValueError(f"agent config {key!r} names itself {agent.name!r}")
        agents[key] = agent
    return agents


def build_callbacks(cfg: DictConfig) -> list[Any]:
    """Every non-null entry under ``cfg.callbacks``."""
    return [
        hydra.utils.instantiate(c, _convert_="all")
        for c in (cfg.get("callbacks") or {}).values()
        if c
    ]


def build_logger(cfg: DictConfig) -> Any:
    """The configured Lightning logger, or False when ``logger`` is null."""
    if not cfg.get("logger"):
        return False
    uri = cfg.logger.get("tracking_uri")
    if uri and str(uri).startswith("sqlite:///"):
        Path(str(uri)[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    return hydra.utils.instantiate(cfg.logger, _convert_="all")


def build_sandbox(cfg: DictConfig) -> Any:
    """The configured sandbox (the caller closes it)."""
    return hydra.utils.instantiate(cfg.sandbox, _convert_="all")


def build_grader(cfg: DictConfig, sandbox: Any, **overrides: Any) -> Any:
    """The grader of ``cfg.grader`` (a `_target_` config) running on `sandbox`."""
    return hydra.utils.instantiate(cfg.grader, _partial_=True)(sandbox=sandbox, **overrides)


def build_problems(cfg: DictConfig, part: str, limit: int | None = None) -> list[Any]:
    """The problems of ``cfg.data.<part>`` (train, eval or warm_start), checked and limited."""
    return load_problem_set(cfg, part, limit)


def flat_params(cfg: DictConfig) -> dict[str, Any]:
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
