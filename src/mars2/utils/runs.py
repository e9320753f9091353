"""Which run folder a command writes into, and which checkpoint a resumed run starts from.

`ckpt_path=<run>/checkpoints/last.ckpt` (training) and `resume=true` (the newest run of this
experiment) or `resume=<run folder>` continue the same folder, so its trees, views, checkpoints
and MLflow run (see `mars2.utils.tracking`) carry on. The folder is chosen by the
`${mars2_run_dir:...}` resolver that `configs/hydra/default.yaml` uses for `hydra.run.dir`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import OmegaConf

CHECKPOINT_DIR = "checkpoints"
RESOLVER = "mars2_run_dir"


class RunFolderError(ValueError):
    """A run folder or checkpoint that cannot be used; the message names the setting."""


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "0", "null", "none")
    return bool(value)


def checkpoints_of(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run folder, oldest first (`last.ckpt` counts as newest)."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    files = [p for p in folder.glob("*.ckpt") if p.is_file() and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (p.name == "last.ckpt", p.stat().st_mtime, p.name))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """`last.ckpt` of the run folder, else its newest step checkpoint, else None."""
    found = checkpoints_of(run_dir)
    return found[-1] if found else None


def _latest_run(runs_root: Path, task: str) -> Path | None:
    if not runs_root.is_dir():
        return None
    candidates = []
    for folder in runs_root.iterdir():
        if not folder.is_dir():
            continue
        if task == "train":
            newest = latest_checkpoint(folder)
            if newest is not None:
                candidates.append((newest.stat().st_mtime, folder.name, folder))
        elif (folder / "results").is_dir():
            candidates.append((folder.stat().st_mtime, folder.name, folder))
    return max(candidates)[2] if candidates else None


def check_writable(folder: str | Path, setting: str) -> None:
    """Fail with the path and the setting that chose it if `folder` cannot be written."""
    path = Path(folder)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        why = f"{probe} is a file, not a folder"
    elif not os.access(probe, os.W_OK | os.X_OK):
        why = f"{probe} does not let this user (uid {os.getuid()}) create files"
    else:
        return
    raise RunFolderError(
        f"the run folder {path} (chosen by {setting}) is not writable: {why}. Pick a writable "
        "folder with hydra.run.dir=... or paths.log_dir=..., or fix the folder's permissions."
    )


def choose_run_dir(
    task: str, ckpt_path: Any, resume: Any, runs_root: str, fresh: str
) -> str:  # fmt: skip
    """The run folder: the checkpoint's own run (training), the resumed run, or a fresh one."""
    root = Path(runs_root)
    if task == "train" and ckpt_path:
        ckpt = Path(str(ckpt_path)).expanduser()
        if not ckpt.exists():
            raise RunFolderError(
                f"ckpt_path={ckpt_path}: no such checkpoint. Checkpoints are written to "
                f"<run folder>/{CHECKPOINT_DIR}/ (last.ckpt is the newest); resume=true finds "
                f"the newest run of this experiment under {root}."
            )
        folder = ckpt.resolve().parent
        chosen = folder.parent if folder.name == CHECKPOINT_DIR else Path(fresh)
        check_writable(chosen, "ckpt_path (a resumed run writes into its own folder)")
        return str(chosen)
    if _truthy(resume):
        if isinstance(resume, str) and resume.strip().lower() != "true":
            chosen = Path(resume).expanduser()
            if not chosen.is_dir():
                raise RunFolderError(
                    f"resume={resume}: no such run folder. Pass a folder under {root} or "
                    "resume=true for the newest run of this experiment."
                )
        else:
            latest = _latest_run(root, task)
            if latest is None:
                what = "a checkpoint" if task == "train" else "results"
                raise RunFolderError(
                    f"resume=true found no run with {what} under {root} (experiment_name picks "
                    "the folder); start a fresh run without resume, or pass resume=<run folder>."
                )
            chosen = latest
        check_writable(chosen, "resume")
        return str(chosen)
    check_writable(fresh, "hydra.run.dir (default: paths.log_dir/<task>/runs/<experiment>/<time>)")
    return fresh


def resolve_checkpoint(cfg: Any) -> str | None:
    """The checkpoint a training run starts from: `ckpt_path`, or with `resume` the newest one in
    the run folder; None for a fresh run."""
    if cfg.get("ckpt_path"):
        return str(cfg.ckpt_path)
    if _truthy(cfg.get("resume")):
        out = Path(str(cfg.paths.output_dir))
        found = latest_checkpoint(out)
        if found is None:
            raise RunFolderError(
                f"resume is set but {out / CHECKPOINT_DIR} holds no checkpoint; the run stopped "
                "before its first one (callbacks.checkpoint.every_n_train_steps)."
            )
        return str(found)
    return None


def register_resolver() -> None:
    """Make `${mars2_run_dir:task,ckpt_path,resume,runs_root,fresh}` available to configs."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, choose_run_dir)


class RunFolderCheck(HydraCallback):
    """Hydra callback: refuse an unwritable run folder before Hydra tries to create it (the
    error names the folder and `hydra.run.dir` instead of a bare PermissionError traceback)."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        folder = OmegaConf.select(config, "hydra.run.dir")
        if not folder:
            return
        try:
            probe_writable(Path(str(folder)), "hydra.run.dir")
        except RunFolderError as error:
            # Hydra turns a callback's exception into a warning and goes on to fail in mkdir.
            print(f"Error: {error}", file=sys.stderr)
            raise SystemExit(1) from error


def probe_writable(folder: Path, setting: str) -> None:
    """Create `folder` and a file in it (what the run will do anyway); a failure names both."""
    check_writable(folder, setting)
    probe = folder / f".mars2-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise RunFolderError(
            f"the run folder {folder} (chosen by {setting}) is not writable: "
            f"{error.strerror or error} ({error.filename or folder}). Pick a writable folder with "
            "hydra.run.dir=... or paths.log_dir=..., or fix the folder's permissions."
        ) from error
