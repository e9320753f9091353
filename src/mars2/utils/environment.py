"""Checks of what a run needs from this machine and the files it names, made before any model
loads (the command line runs them before it creates the run folder, once per job of a ``-m``
sweep): the accelerator a trainer config asks for, the packages of each generation backend, data
paths that are files, a `ckpt_path` that is a checkpoint, and an MLflow tracking server that answers. Each failure is one `ConfigError`
paragraph naming the fix."""

from __future__ import annotations

import importlib.util
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mars2.utils.runs import CHECKPOINT_DIR, latest_checkpoint
from mars2.utils.validation import ConfigError

_GPU_ACCELERATORS = {"gpu", "cuda"}
# The packages each generation backend imports (beyond the core install).
_BACKEND_PACKAGES = {"vllm": ("vllm",)}
# Lightning loggers whose packages are optional: (any one of these imports, what to install).
_LOGGER_PACKAGES = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "pip install '.[tensorboard]'"),
    "WandbLogger": (("wandb",), "pip install '.[wandb]' (then wandb login, or WANDB_MODE=offline)"),
}


def check_accelerator(cfg: DictConfig) -> None:
    """A trainer config that asks for GPUs (trainer=gpu, ddp, fsdp) on a machine without CUDA."""
    trainer = cfg.get("trainer") or {}
    accelerator = str(trainer.get("accelerator", "cpu")).lower()
    if accelerator not in _GPU_ACCELERATORS:
        return
    import torch

    if torch.cuda.is_available():
        return
    raise ConfigError(
        f"trainer.accelerator={accelerator} asks for a CUDA GPU, and this machine has none "
        "(torch.cuda.is_available() is False: no GPU, no driver, or a CPU-only torch). Run on "
        "the CPU with trainer.accelerator=cpu trainer.devices=2 (or trainer=cpu), or install the "
        "CUDA build of torch on a GPU machine (see docs/gpu.md)."
    )


def check_backends(cfg: DictConfig) -> None:
    """Every agent's generation backend has its packages installed."""
    for name, agent in (cfg.get("agents") or {}).items():
        backend = str((agent.get("generation") or {}).get("backend", "transformers"))
        for package in _BACKEND_PACKAGES.get(backend, ()):
            if importlib.util.find_spec(package) is None:
                raise ConfigError(
                    f"agents.{name}.generation.backend={backend} needs the {package} package, "
                    f"which this Python does not have: pip install '.[gpu]' (GPU machines), or "
                    f"use agents.{name}.generation.backend=transformers."
                )


def check_logger(cfg: DictConfig) -> None:
    """The configured logger's package imports (logger=tensorboard, logger=wandb)."""
    logger = cfg.get("logger")
    target = str(logger.get("_target_", "")) if isinstance(logger, DictConfig) else ""
    needed = _LOGGER_PACKAGES.get(target.rsplit(".", 1)[-1])
    if needed is None:
        return
    packages, install = needed
    if any(importlib.util.find_spec(p) is not None for p in packages):
        return
    raise ConfigError(
        f"the logger {target.rsplit('.', 1)[-1]} ({target}) needs {' or '.join(packages)}, which "
        f"this Python does not have: {install}; or use logger=mlflow (the default), logger=csv "
        "or ~logger."
    )


def check_tracking_server(cfg: DictConfig, timeout: float = 5.0) -> None:
    """An MLflow `logger.tracking_uri` that is an HTTP server answers its `/health` route.

    Without this, MLflow's client retries a refused connection for minutes inside the first
    logging call (after the models have loaded) and then fails in a traceback."""
    logger = cfg.get("logger")
    uri = str(logger.get("tracking_uri") or "") if isinstance(logger, DictConfig) else ""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return
    except urllib.error.HTTPError as error:
        if error.code < 500:  # it answers (a proxy or an auth layer in front of it): reachable
            return
        reason = f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        reason = str(getattr(error, "reason", error))
    raise ConfigError(
        f"the MLflow tracking server logger.tracking_uri={uri} does not answer ({reason}): "
        "start it (for example `mlflow server --backend-store-uri sqlite:///logs/mlflow/mlflow.db "
        "--port 5000`), point logger.tracking_uri at one that runs, or drop the override to use "
        "the local sqlite store under logs/ (or logger=csv)."
    )


def check_data_files(cfg: DictConfig, parts: tuple[str, ...]) -> None:
    """`data.<part>.path`, where set, is a file (a folder is refused with the file it wants)."""
    data = cfg.get("data") or {}
    for part in parts:
        node = data.get(part)
        if not isinstance(node, DictConfig):
            continue
        path = node.get("path")
        if path is None or not Path(str(path)).is_dir():
            continue
        inside = sorted(p.name for p in Path(str(path)).glob("*.json*"))[:3]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise ConfigError(
            f"data.{part}.path={path} is a folder{hint}; the loader "
            f"{node.get('_target_', '?')} reads one file. Point data.{part}.path at the "
            f"jsonl file itself, e.g. data.{part}.path={path}/train.jsonl."
        )


def is_checkpoint(path: Path) -> bool:
    """Whether `path` looks like a Lightning checkpoint (torch.save writes a zip archive)."""
    return path.is_file() and zipfile.is_zipfile(path)


def check_checkpoint(cfg: DictConfig, task: str) -> str | None:
    """`ckpt_path` exists and is a checkpoint; a run folder resolves to its newest checkpoint
    (returned, for the caller to use), an agents/ export is refused naming what to pass."""
    given = cfg.get("ckpt_path")
    if not given:
        return None
    path = Path(str(given)).expanduser()
    if not path.exists():
        raise ConfigError(
            f"ckpt_path={given}: no such checkpoint. Checkpoints are written to <run folder>/"
            f"{CHECKPOINT_DIR}/ (last.ckpt is the newest); pass that file"
            + (
                ", or resume=true to continue the newest run of the experiment."
                if task == "train"
                else ", or the run folder itself."
            )
        )
    if path.is_dir():
        run = _run_folder_of(path)
        if run is None:
            raise ConfigError(
                f"ckpt_path={given} is a folder with no checkpoints/ inside; pass a checkpoint "
                f"file (<run folder>/{CHECKPOINT_DIR}/last.ckpt) or a run folder that has one."
            )
        found = latest_checkpoint(run)
        if path.name == "agents" or path.parent.name == "agents":
            what = f"the Hugging Face export of {run}"
            raise ConfigError(
                f"ckpt_path={given} is {what}, not a checkpoint. Pass "
                f"ckpt_path={found or run / CHECKPOINT_DIR / 'last.ckpt'} (the run's checkpoint), "
                f"or load one exported agent as a model with agents.<name>.model.path={path}."
            )
        if found is None:
            raise ConfigError(
                f"ckpt_path={given} is a run folder without a checkpoint (it stopped before its "
                f"first one); there is nothing to load from it."
            )
        if task == "train":
            raise ConfigError(
                f"ckpt_path={given} is a run folder; pass its checkpoint, ckpt_path={found}, or "
                f"continue it with resume={run}."
            )
        return str(found)
    if not is_checkpoint(path):
        raise ConfigError(
            f"ckpt_path={given} is not a checkpoint (a Lightning .ckpt is a zip archive written "
            f"by torch.save); pass <run folder>/{CHECKPOINT_DIR}/last.ckpt."
        )
    return None


def _run_folder_of(path: Path) -> Path | None:
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / CHECKPOINT_DIR).is_dir() or (candidate / ".hydra").is_dir():
            return candidate
    return None


def check_environment(cfg: DictConfig, task: str) -> Any:
    """All of the above for `task` ("train" or "eval"); returns a resolved checkpoint or None."""
    if task == "train":
        check_accelerator(cfg)
    check_backends(cfg)
    check_logger(cfg)
    check_tracking_server(cfg)
    check_data_files(cfg, ("train", "warm_start") if task == "train" else ("eval",))
    return check_checkpoint(cfg, task)
