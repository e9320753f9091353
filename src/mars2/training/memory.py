"""The memory estimate of a composed training config: checked at start-up, printed by a dry run.

python -m mars2.training.memory experiment=areal14b_pair trainer=fsdp memory.gpu=h100
python -m mars2.training.memory --table      # every shipped experiment (the README table)

Arguments are the training command's Hydra overrides; memory.gpu (h200, h100, a100 or GiB),
memory.gpus_per_node and memory.prompt_tokens set what the dry run assumes. Exit status: 0 when
the estimate fits, 1 when it does not or the overrides cannot be composed.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mars2.models.memory import (
    DEFAULT_LOGPROB_CHUNK_TOKENS,
    GPU_GIB,
    AgentPlan,
    ClusterPlan,
    EnginePlan,
    MemoryEstimate,
    ModelShape,
    check,
    estimate,
)

log = logging.getLogger(__name__)
DEFAULTS = {"check": True, "gpu": None, "gpus_per_node": 8, "prompt_tokens": 2048}
SHARDED_STRATEGIES = ("MultiAgentFSDPStrategy", "FSDPStrategy", "ModelParallelStrategy")


def _settings(cfg: DictConfig) -> dict[str, Any]:
    given = cfg.get("memory") or {}
    return {**DEFAULTS, **OmegaConf.to_container(OmegaConf.create(dict(given)), resolve=True)}  # type: ignore[dict-item]


def model_shape(name: str, model: dict[str, Any]) -> ModelShape:
    """Declared `model.architecture`, else the local `config.json` (no hub access)."""
    declared = model.get("architecture")
    if declared:
        return ModelShape.from_mapping(dict(declared))
    found = ModelShape.from_pretrained_dir(str(model["path"])) or _from_hub_cache(
        str(model["path"])
    )
    if found is None:
        raise ValueError(
            f"agent {name}: cannot size {model['path']!r} for the memory estimate: declare "
            "model.architecture (hidden_size, num_hidden_layers, intermediate_size, vocab_size, "
            "num_attention_heads, num_key_value_heads, head_dim) or point model.path at a local "
            "directory with config.json"
        )
    return found


def _from_hub_cache(repo_id: str) -> ModelShape | None:
    """The config.json of a hub model already in the local Hugging Face cache (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the hub client rejects is simply not cached
        return None
    return ModelShape.from_pretrained_dir(Path(cached).parent) if isinstance(cached, str) else None


def agent_plan(
    name: str, agent: dict[str, Any], prompt_tokens: int, mixed_precision: bool = False
) -> AgentPlan:
    """One agent's memory plan from its resolved config."""
    model = agent["model"]
    generation = agent.get("generation") or {}
    loss = agent.get("loss") or {}
    optim = agent.get("optim") or {}
    lora = model.get("lora")
    seq_len = int(generation.get("max_prompt_tokens") or prompt_tokens) + int(
        generation.get("max_new_tokens", 256)
    )
    engine = None
    if generation.get("backend") == "vllm":
        vllm = dict(generation.get("vllm") or {})
        engine = EnginePlan(
            gpu_memory_utilization=float(vllm.get("gpu_memory_utilization", 0.3)),
            sleep=bool(vllm.get("enable_sleep_mode", False)),
            # the same length the engine is given (GenerationConfig.max_model_len)
            max_model_len=int(vllm.get("max_model_len") or seq_len),
            key=str(model["path"]) if vllm.get("shared_base") and lora else name,
            tensor_parallel_size=int(vllm.get("tensor_parallel_size") or 1),
        )
    return AgentPlan(
        name=name,
        shape=model_shape(name, model),
        dtype=str(model.get("dtype", "float32")),
        lora_r=int(lora["r"]) if lora else None,
        lora_targets=tuple(lora["target_modules"]) if lora and lora.get("target_modules") else
        AgentPlan.lora_targets,
        quantization=model.get("quantization"),
        optimizer=str(optim.get("optimizer", "adamw")),
        reference=float(loss.get("beta", 0.0)) > 0 and not lora,
        gradient_checkpointing=bool(model.get("gradient_checkpointing", False)),
        micro_batch_size=int(agent.get("micro_batch_size", 8)),
        seq_len=seq_len,
        mixed_precision=mixed_precision,
        engine=engine,
        logprob_chunk_tokens=int(loss.get("logprob_chunk_tokens", DEFAULT_LOGPROB_CHUNK_TOKENS)),
    )  # fmt: skip


def _gpu_gib(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    key = str(value).lower()
    if key not in GPU_GIB:
        raise ValueError(
            f"unknown memory.gpu {value!r}: use a number of GiB or one of {sorted(GPU_GIB)}"
        )
    return GPU_GIB[key]


def _visible_gpu_gib() -> float | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 1024**3


def cluster_plan(cfg: DictConfig) -> ClusterPlan:
    """GPU size, world size and whether training state is sharded, from trainer + memory keys."""
    settings = _settings(cfg)
    trainer = cfg.trainer
    gpu = _gpu_gib(settings["gpu"]) or _visible_gpu_gib() or GPU_GIB["h200"]
    devices = trainer.get("devices", 1)
    if devices in (None, "auto", -1, "-1"):
        count = _visible_count() or int(settings["gpus_per_node"])
    elif isinstance(devices, int | str) and str(devices).lstrip("-").isdigit():
        count = int(devices)
    else:
        count = len(list(devices))
    world = count * int(trainer.get("num_nodes", 1) or 1)
    strategy = trainer.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy)
    sharded = any(name in str(target) for name in SHARDED_STRATEGIES) or str(target) == "fsdp"
    return ClusterPlan(gpu_gib=gpu, world_size=world, sharded=sharded)


def _visible_count() -> int | None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    return torch.cuda.device_count() or None


def estimate_config(cfg: DictConfig) -> MemoryEstimate:
    """The per-GPU estimate of a composed training config."""
    settings = _settings(cfg)
    cluster = cluster_plan(cfg)  # first: a bad memory.gpu is named before any model is sized
    agents = OmegaConf.to_container(cfg.agents, resolve=True)
    assert isinstance(agents, dict)
    mixed = "16-mixed" in str(cfg.trainer.get("precision", ""))
    prompt = int(settings["prompt_tokens"])
    # A frozen teammate on a server holds nothing on the trainer's GPUs (only its tokenizer); a
    # frozen in-process one is planned as if trained (an over-estimate: no gradients or moments).
    plans = [agent_plan(str(n), a, prompt, mixed) for n, a in agents.items()
             if a.get("trainable", True) or (a.get("generation") or {}).get("backend")
             != "vllm_server"]  # fmt: skip
    return estimate(plans, cluster)


# The trainer config key naming PYTORCH_CUDA_ALLOC_CONF (not a Lightning Trainer argument).
ALLOC_CONF_KEY = "cuda_alloc_conf"
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def trainer_arguments(trainer: DictConfig) -> DictConfig:
    """The trainer config without the keys mars2 reads itself (what `lightning.Trainer` takes);
    a copy under the same parent, so its interpolations (`${steps}`) still resolve."""
    arguments = copy.copy(trainer)
    with open_dict(arguments):
        arguments.pop(ALLOC_CONF_KEY, None)
    return arguments


def apply_allocator_conf(cfg: DictConfig) -> str | None:
    """Export the GPU trainer's `cuda_alloc_conf` as PYTORCH_CUDA_ALLOC_CONF, before CUDA starts.

    The plan leaves 8% of each GPU (`ClusterPlan.usable_fraction`) for fragmentation; with
    expandable segments the caching allocator grows segments in place instead of leaving
    partly-used fixed blocks, which is what keeps fragmentation inside that reserve. vLLM's sleep
    mode pool turns it off around its own allocations (CuMemAllocator.use_memory_pool), so the two
    coexist. A value already in the environment wins (logged); CPU runs set nothing. Returns the
    value in effect.
    """
    wanted = cfg.trainer.get(ALLOC_CONF_KEY)
    if not wanted or str(cfg.trainer.get("accelerator", "cpu")) == "cpu":
        return os.environ.get(ALLOC_CONF_ENV)
    present = os.environ.get(ALLOC_CONF_ENV)
    if present is not None and present != str(wanted):
        log.warning("%s=%s from the environment kept (trainer.%s=%s not applied)",
                    ALLOC_CONF_ENV, present, ALLOC_CONF_KEY, wanted)  # fmt: skip
        return present
    os.environ[ALLOC_CONF_ENV] = str(wanted)
    import torch

    if torch.cuda.is_initialized():  # the allocator read its settings already: too late
        log.warning("%s set after CUDA started: it applies to child processes only", ALLOC_CONF_ENV)
    return str(wanted)


def check_memory(cfg: DictConfig) -> MemoryEstimate | None:
    """At start-up: log the estimate of a GPU run and refuse one that cannot fit (CPU runs pass)."""
    if str(cfg.trainer.get("accelerator", "cpu")) == "cpu" or not _settings(cfg)["check"]:
        return None
    try:
        est = estimate_config(cfg)
    except ValueError as err:  # an agent of unknown size: say so, but do not block the run
        log.warning("memory estimate skipped: %s", err)
        return None
    log.info("%s", est.report())
    check(est)
    return est


# -- dry run -----------------------------------------------------------------------------------

SHIPPED = [
    ("areal14b_pair", ["trainer=ddp"]),
    ("areal14b_pair_qlora", ["trainer=ddp"]),
    ("areal14b_pair_full", ["trainer=fsdp"]),
    ("qwen3_8b_areal8b_pair", []),
    ("qwen3_8b_mars2", []),
    ("qwen3_8b_grpo", []),
    ("qwen3_32b_pair", []),
    ("qwen3_32b_pair_full", []),
]


def _config_dir() -> Path:
    root = os.environ.get("MARS2_ROOT") or Path(__file__).resolve().parents[3]
    return Path(root) / "configs"


def compose(overrides: list[str]) -> DictConfig:
    """The training config for `overrides`, composed as `train.py` would (no run directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(_config_dir()), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def table(gpus: tuple[str, ...] = ("h200", "h100")) -> str:
    """A markdown table: peak per-GPU GiB of every shipped experiment on each GPU kind."""
    head = "| experiment | " + " | ".join(f"{g.upper()} peak GiB (usable)" for g in gpus) + " |"
    lines = [head, "|" + "---|" * (len(gpus) + 1)]
    for experiment, extra in SHIPPED:
        cells = []
        for gpu in gpus:
            est = estimate_config(
                compose([f"experiment={experiment}", *extra, f"memory.gpu={gpu}"])
            )
            verdict = "fits" if est.fits else "**does not fit**"
            if est.problems:
                verdict += " (engine budget too small)"
            cells.append(f"{est.peak:.0f} ({est.cluster.usable_gib:.0f}) {verdict}")
        name = " ".join([f"`{experiment}`", *(f"`{e}`" for e in extra)])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _unknown_option(text: str) -> str | None:
    """Hydra's "Could not find 'experiment/x' Available options ..." as our one paragraph."""
    import difflib
    import re

    found = re.search(
        r"Could not (?:find|load) '([^']+)/([^'/]+)'.*?Available options in '[^']+':(.*)", text
    )
    if not found:
        return None
    group, name, rest = found.groups()
    options = rest.split()
    near = difflib.get_close_matches(name, options, n=1)
    hint = f" (did you mean {group}={near[0]}?)" if near else ""
    return (
        f"{group}={name}: there is no {group} config named {name!r}{hint}. The {group} configs "
        f"are: {', '.join(options)}."
    )


def main(argv: list[str] | None = None) -> int:
    """Print the estimate of the overrides' config (or the table); errors are one paragraph."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        if args[:1] == ["--table"]:
            print(table())
            return 0
        est = estimate_config(compose(args))
    except (HydraException, OmegaConfBaseException, ValueError, KeyError) as error:
        text = str(error).strip().split("Config search path")[0]  # Hydra appends its search path
        text = " ".join(line.strip() for line in text.splitlines() if line.strip())
        text = _unknown_option(text) or text or type(error).__name__
        print(f"Error: {text} (python -m mars2.training.memory --help)", file=sys.stderr)
        return 1
    print(est.report())
    if not est.fits:
        print("\n" + est.refusal())
    return 0 if est.fits else 1


if __name__ == "__main__":
    sys.exit(main())
