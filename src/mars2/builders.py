"""Objects a training or an evaluation run builds from its composed Hydra config.

Shared by `mars2.training.run` and `mars2.eval.run`; it sits below both and imports neither.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from mars2.search.prompt_fit import PromptCap, fitting_problems
from mars2.search.prompts import PromptBuilder
from mars2.utils.validation import ConfigError, load_problem_set

log = logging.getLogger(__name__)

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
    """The problems of ``cfg.data.<part>`` (train, eval or warm_start), checked and limited;
    where agents cap their prompts (`generation.max_prompt_tokens`), only rows whose uncut
    prompts fit every cap (`mars2.search.prompt_fit`): ``data.<part>.too_long`` refuses the
    first that does not (``refuse``, the default) or leaves them out, counted in the log
    (``skip``). Run before any model loads (the checks of `mars2.training.run.check_train` and
    `mars2.eval.run.check_eval`)."""
    caps = prompt_caps(cfg)
    if not caps:
        return load_problem_set(cfg, part, limit)
    problems = load_problem_set(cfg, part)
    node = cfg.data[part]
    too_long = str(node.get("too_long") or "refuse")
    prompts = split_prompts(cfg, part)
    key = (
        part,
        OmegaConf.to_yaml(node, resolve=True),
        tuple(id(p) for p in problems[:1]),  # a reloaded (changed) file is checked again
        limit,
        tuple((c.agent, id(c.tokenizer), c.max_prompt_tokens) for c in caps),
        prompts,
    )
    if key not in _FITTED:
        kept, left_out = fitting_problems(problems, prompts, caps, too_long, part, limit)
        if left_out:
            first = left_out[0]
            log.warning(
                "data.%s: left out %d row(s) with a prompt over an agent's "
                "generation.max_prompt_tokens (too_long=skip), kept %d; first: %s, %d tokens "
                "for %s (cap %d)",
                part, len(left_out), len(kept), first.where, first.length, first.cap.agent,
                first.cap.max_prompt_tokens,
            )  # fmt: skip
        if not kept:
            raise ConfigError(
                f"data.{part}: every row makes a prompt over an agent's "
                f"generation.max_prompt_tokens ({len(left_out)} left out with too_long=skip); "
                "raise the cap (agents.<name>.generation.max_prompt_tokens) or use shorter rows."
            )
        _FITTED[key] = kept
    return list(_FITTED[key])


# Problem sets already fitted to the prompt caps in this process (the command line's check and
# the run's builders ask for the same ones), and the tokenizers they were fitted with.
_FITTED: dict[tuple[Any, ...], list[Any]] = {}
_TOKENIZERS: dict[tuple[str, bool], Any] = {}


def prompt_caps(cfg: DictConfig) -> list[PromptCap]:
    """Each agent that caps its prompts, with its tokenizer (tokenizers only, no model loads);
    none where an evaluation samples the problems' reference answers."""
    if (cfg.get("generation") or {}).get("backend") == "reference":
        return []
    caps = []
    for name, agent in (cfg.get("agents") or {}).items():
        cap = (agent.get("generation") or {}).get("max_prompt_tokens")
        if cap is None:
            continue
        model = agent.get("model") or {}
        source = (str(model.get("path")), bool(model.get("trust_remote_code", False)))
        if source not in _TOKENIZERS:
            from mars2.models.loading import ModelLoadError, load_tokenizer

            try:
                _TOKENIZERS[source] = load_tokenizer(*source)
            except ModelLoadError as error:
                raise ConfigError(
                    f"agents.{name}.model.path: {error}; its tokenizer measures the prompts "
                    f"against agents.{name}.generation.max_prompt_tokens={cap}."
                ) from error
        caps.append(PromptCap(str(name), _TOKENIZERS[source], int(cap)))
    return caps


def split_prompts(cfg: DictConfig, part: str) -> PromptBuilder:
    """The prompt templates a split's problems are asked with: the search's for training
    problems; the warm start and evaluation use the default templates."""
    if part == "train" and (cfg.get("search") or {}).get("prompts") is not None:
        built: PromptBuilder = hydra.utils.instantiate(cfg.search.prompts, _convert_="all")
        return built
    return PromptBuilder()


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
