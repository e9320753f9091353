"""Which run folder a command writes into, and which checkpoint a resumed run starts from.

`ckpt_path=<run>/checkpoints/last.ckpt` (training) and `resume=true` or `resume=<run folder>`
continue the same folder, so its trees, views, checkpoints and MLflow run (see
`mars2.utils.tracking`) carry on. Training resumes the newest run of the experiment that holds a
checkpoint, finished or not; a folder without one (an attempt that failed or was stopped before
its first checkpoint) is skipped and named, never trained again from step 0. An
evaluation resumes only a run whose `eval_record.json` (every setting its rows depend on) matches,
so rows made with other weights, data or settings are never mixed in. The folder is chosen by
the `${mars2_run_dir:...}` resolver that `configs/hydra/default.yaml` uses for `hydra.run.dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import OmegaConf

from mars2.utils.atomic import atomic_write_text

CHECKPOINT_DIR = "checkpoints"
RESOLVER = "mars2_run_dir"


class RunFolderError(ValueError):
    """A run folder or checkpoint that cannot be used; the message names the setting."""


def truthy(value: Any) -> bool:
    """A setting given as true (``resume=true``, ``resume=<folder>``); false, 0, null are not."""
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


def _last_active(folder: Path) -> float:
    """When a command last worked in a run folder (Hydra rewrites `.hydra/config.yaml` at each
    start; checkpoints and the folder's own entries change as it runs)."""
    stamps = [folder.stat().st_mtime]
    for path in (folder / ".hydra" / "config.yaml", latest_checkpoint(folder)):
        if path is not None and path.exists():
            stamps.append(path.stat().st_mtime)
    return max(stamps)


def runs_newest_first(runs_root: str | Path) -> list[Path]:
    """The run folders of one experiment, the most recently active first."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    folders = [f for f in root.iterdir() if f.is_dir() and not f.name.startswith(".")]
    return sorted(folders, key=lambda f: (_last_active(f), f.name), reverse=True)


# --- what defines an evaluation's numbers -------------------------------------------------------

EVAL_RECORD = "eval_record.json"
# The settings an evaluation's rows depend on; paths, logging, worker counts, training-only
# settings (optimizer, loss) and search.config.max_nodes (eval.tree_budget replaces it) are left
# out.
RECORD_KEYS = ("seed", "eval", "data.eval", "generation", "search.config", "grader", "sandbox")
_AGENT_RECORD_PARTS = ("model", "generation")
_NOT_RESULTS = {
    "sandbox.num_workers", "search.config.max_nodes", "eval.allow_untrained", "eval.tree_pages"
}  # fmt: skip
_FINGERPRINT_BYTES = 1 << 20


def fingerprint(path: str | Path) -> str:
    """A cheap identity of a (possibly multi-GB) file: its size and hashes of its first and last
    MiB; any rewrite of a checkpoint or data file changes it."""
    file = Path(path)
    digest = hashlib.sha256(str(file.stat().st_size).encode())
    with open(file, "rb") as handle:
        digest.update(handle.read(_FINGERPRINT_BYTES))
        handle.seek(max(0, file.stat().st_size - _FINGERPRINT_BYTES))
        digest.update(handle.read(_FINGERPRINT_BYTES))
    return f"sha256:{digest.hexdigest()[:16]} ({file.stat().st_size} bytes)"


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, child in value.items():
            _flatten(child, f"{prefix}.{key}", out)
    elif prefix not in _NOT_RESULTS:
        out[prefix] = json.dumps(value, sort_keys=True, default=str)


def eval_record(cfg: Any) -> dict[str, str]:
    """Dotted key -> value of every setting an evaluation's rows depend on: the data selection
    (and its file's fingerprint), the checkpoint's fingerprint, the agents, every eval.* setting,
    the search, the grader, the sandbox limits and the seed."""
    out: dict[str, str] = {}
    for key in RECORD_KEYS:
        node = OmegaConf.select(cfg, key, default=None)
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        _flatten(value, key, out)
    for name, agent in (OmegaConf.select(cfg, "agents", default=None) or {}).items():
        for part in _AGENT_RECORD_PARTS:
            node = agent.get(part)
            value = (
                OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
            )
            _flatten(value, f"agents.{name}.{part}", out)
    for key in ("ckpt_path", "data.eval.path"):
        given = OmegaConf.select(cfg, key, default=None)
        if given and Path(str(given)).is_file():
            out[f"{key} (file)"] = fingerprint(str(given))
    return out


def record_differences(old: dict[str, str], new: dict[str, str], shown: int = 6) -> str:
    """`key (old -> new)` for the settings that differ, the first `shown` of them."""
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    parts = [f"{k} ({old.get(k, 'unset')} -> {new.get(k, 'unset')})" for k in keys[:shown]]
    if len(keys) > shown:
        parts.append(f"and {len(keys) - shown} more")
    return ", ".join(parts)


def read_record(folder: str | Path) -> dict[str, str] | None:
    path = Path(folder) / EVAL_RECORD
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return dict(data.get("settings", {})) if isinstance(data, dict) else None


def write_record(folder: str | Path, record: dict[str, str]) -> None:
    text = json.dumps({"settings": record}, indent=1, sort_keys=True) + "\n"
    atomic_write_text(Path(folder) / EVAL_RECORD, text)


def _has_rows(folder: Path) -> bool:
    return any((folder / "results").glob("*.jsonl"))


def check_eval_folder(folder: str | Path, record: dict[str, str], setting: str) -> None:
    """Refuse to add rows to `folder` when its rows were made with other settings."""
    path = Path(folder)
    kept = read_record(path)
    if kept is None:
        if _has_rows(path):
            raise RunFolderError(
                f"{setting}={path} holds results but no {EVAL_RECORD} (an older mars2 kept no "
                "record of its settings), so its rows cannot be matched to these settings; "
                "evaluate into a new folder (drop resume)."
            )
        return
    if kept != record:
        raise RunFolderError(
            f"{setting}={path} was evaluated with other settings: {record_differences(kept, record)}. "
            "Its rows would mix with these; resume with the same settings, or drop resume to "
            "start a new evaluation."
        )


def matching_eval_run(runs_root: str | Path, record: dict[str, str]) -> tuple[Path | None, str]:
    """The newest evaluation under `runs_root` made with exactly `record`, else None and why."""
    newest: tuple[Path, dict[str, str]] | None = None
    for folder in runs_newest_first(runs_root):
        kept = read_record(folder)
        if kept is None:
            continue
        if kept == record:
            return folder, f"resume=true: continuing {folder} (same settings)"
        newest = newest or (folder, kept)
    if newest is None:
        return None, f"resume=true: no earlier evaluation under {runs_root}; starting a new one"
    folder, kept = newest
    return None, (
        f"resume=true: no earlier evaluation has these settings (the newest, {folder.name}, "
        f"differs in {record_differences(kept, record)}); starting a new one, nothing reused"
    )


def resumable_run(runs_root: str | Path) -> tuple[Path | None, list[Path]]:
    """The newest run under `runs_root` that holds a checkpoint, and the newer folders skipped
    because they hold none (attempts that failed or were stopped before their first one)."""
    skipped: list[Path] = []
    for folder in runs_newest_first(runs_root):
        if latest_checkpoint(folder) is not None:
            return folder, skipped
        skipped.append(folder)
    return None, skipped


def _named(folders: list[Path], shown: int = 3) -> str:
    names = [f.name for f in folders[:shown]]
    more = f" and {len(folders) - shown} more" if len(folders) > shown else ""
    return ", ".join(names) + more


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
    task: str, ckpt_path: Any, resume: Any, runs_root: str, fresh: str, _root_: Any = None
) -> str:  # fmt: skip
    """The run folder: the checkpoint's own run (training), the resumed run, or a fresh one.

    Training `resume=true` takes the newest run of the experiment that holds a checkpoint,
    finished or not (folders without one are skipped: see `resumable_run`). Evaluation
    `resume=true` takes the newest run whose settings match exactly, else a fresh folder;
    `resume=<folder>` with other settings is refused (`_root_`, the whole config, gives them).
    """
    root = Path(runs_root)
    if task == "train" and ckpt_path:
        ckpt = Path(str(ckpt_path)).expanduser()
        if not ckpt.exists():
            raise RunFolderError(
                f"ckpt_path={ckpt_path}: no such checkpoint. Checkpoints are written to "
                f"<run folder>/{CHECKPOINT_DIR}/ (last.ckpt is the newest); resume=true continues "
                f"the newest run of this experiment under {root}."
            )
        folder = ckpt.resolve().parent
        chosen = folder.parent if folder.name == CHECKPOINT_DIR else Path(fresh)
        check_writable(chosen, "ckpt_path (a resumed run writes into its own folder)")
        return str(chosen)
    if truthy(resume):
        record = eval_record(_root_) if task == "eval" and _root_ is not None else None
        if isinstance(resume, str) and resume.strip().lower() != "true":
            chosen = Path(resume).expanduser()
            if not chosen.is_dir():
                raise RunFolderError(
                    f"resume={resume}: no such run folder. Pass a folder under {root} or "
                    "resume=true for the newest run of this experiment."
                )
            if record is not None:
                check_eval_folder(chosen, record, "resume")
            elif task == "train" and latest_checkpoint(chosen) is None:
                raise RunFolderError(
                    f"resume={resume} has no checkpoint (it stopped before its first one, under "
                    f"{chosen / CHECKPOINT_DIR}): there is nothing to resume, and training it "
                    "from step 0 would run a failed attempt's folder with this command's "
                    "settings. Start a fresh run without resume."
                )
        elif task == "train":
            found, skipped = resumable_run(root)
            if found is None:
                without = (
                    f" ({_named(skipped)} stopped before their first checkpoint: nothing to "
                    "resume, they are left as they are)"
                    if skipped
                    else ""
                )
                raise RunFolderError(
                    f"resume=true found no run with a checkpoint under {root}{without} "
                    "(experiment_name picks the folder); start a fresh run without resume, or "
                    "pass resume=<run folder>."
                )
            chosen = found
        else:
            match = matching_eval_run(root, record) if record is not None else (None, "")
            if match[0] is None:
                check_writable(fresh, "hydra.run.dir")
                return fresh
            chosen = match[0]
        check_writable(chosen, "resume")
        return str(chosen)
    check_writable(fresh, "hydra.run.dir (default: paths.log_dir/<task>/runs/<experiment>/<time>)")
    return fresh


def resolve_checkpoint(cfg: Any) -> str | None:
    """The checkpoint a training run starts from: `ckpt_path`, or with `resume` the newest one in
    the run folder (`choose_run_dir` only picks folders that have one); None for a fresh run."""
    if cfg.get("ckpt_path"):
        return str(cfg.ckpt_path)
    if truthy(cfg.get("resume")):
        found = latest_checkpoint(Path(str(cfg.paths.output_dir)))
        return str(found) if found is not None else None
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
