"""Checkpoints that survive a full disk, and a `last.ckpt` that holds the last completed step.

`last.ckpt` is also written when the run ends between two checkpoint intervals and, where the
state is consistent, when it is stopped: SIGTERM (Lightning finishes the step first) and Ctrl-C
(single process; a step whose rollout was still running is rolled back to its start, a step whose
agents were already being updated gets no checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mars2.training.members import team_members
from mars2.utils.atomic import fsync_dir, write_error
from mars2.utils.tracking import flush_step_metrics

log = logging.getLogger(__name__)

# A resumed run writes into its own checkpoint folder again: that is the point, not a mistake.
warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")


def _checkpoint_size(trainer: pl.Trainer, weights_only: bool) -> int | None:
    """Bytes the checkpoint takes once serialised (only asked for after a failed write)."""
    try:
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.tell()
    except Exception:  # the size is a courtesy in an error message; never mask the real error
        return None


@dataclass
class _StepStart:
    """What a step may change before its agents are updated: kept to roll an interrupted step
    back to its start."""

    global_step: int
    weights: dict[str, int]
    datamodule: dict[str, Any] | None


def _weights(module: pl.LightningModule) -> dict[str, int]:
    """Each agent's weights version (a module that is not an agent or a team has none)."""
    if not hasattr(module, "agents") and not hasattr(module, "weights_version"):
        return {}
    return {name: int(agent.weights_version) for name, agent in team_members(module).items()}


def _as_at_step_end(trainer: pl.Trainer) -> bool:
    """Set the loop counters Lightning saves to what a checkpoint written at the end of the last
    completed step holds, so a resume restarts exactly as from such a checkpoint (stopped
    mid-step, Lightning had counted the step as started). Uses the loop's private state
    (Lightning 2.x); says False when it is not as expected."""
    try:
        loop = trainer.fit_loop.epoch_loop
        total: Any = loop.batch_progress.total
        current: Any = loop.batch_progress.current
        shift = total.completed - trainer.global_step
        if shift not in (0, -1):
            return False
        for progress in (total, current):
            progress.completed = progress.completed - shift - 1
            progress.ready = progress.started = progress.processed = progress.completed + 1
        loop._batches_that_stepped = trainer.global_step - 1
    except AttributeError:
        return False
    return True


class AtomicModelCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that writes `<name>.tmp`, fsyncs it and renames it over `<name>`.

    A write that fails midway (full disk, quota, lost mount) leaves the previous `last.ckpt`
    complete and loadable, and the error says how much space the checkpoint needs. Files of a
    step redone after a resume replace the old ones (no `-v1` copies).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)
        self._step_start: _StepStart | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             *args: Any) -> None:  # fmt: skip
        # Batches are pulled inside training_step, so this runs before the step's rollout.
        datamodule = getattr(trainer, "datamodule", None)
        state = copy.deepcopy(datamodule.state_dict()) if datamodule is not None else None
        self._step_start = _StepStart(trainer.global_step, _weights(pl_module), state)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           *args: Any) -> None:  # fmt: skip
        self._step_start = None
        super().on_train_batch_end(trainer, pl_module, *args)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """`last.ckpt` holds the final step even when it falls between checkpoint intervals."""
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:  # fmt: skip
        """Ctrl-C or SIGTERM: write `last.ckpt` at the last completed step where that state is
        still at hand (see the module docstring)."""
        sigterm = isinstance(exception, SIGTERMException)
        if not self.save_last or not (sigterm or isinstance(exception, KeyboardInterrupt)):
            return
        if not sigterm and trainer.world_size > 1:  # ranks stop at different points
            return
        start = self._step_start
        if start is not None and trainer.global_step == start.global_step:
            if _weights(pl_module) != start.weights:
                log.warning(
                    "stopped while the agents were being updated: no checkpoint of this step; "
                    "%s holds the last one saved",
                    self.last_model_path or "no checkpoint",
                )
                return
            datamodule = getattr(trainer, "datamodule", None)
            if datamodule is not None and start.datamodule is not None:
                datamodule.load_state_dict(start.datamodule)  # the step's rollout is redone
        if trainer.global_step == 0:
            return  # nothing trained yet: resume=true restarts the run from step 0 in its folder
        if self._last_global_step_saved == trainer.global_step and self.last_model_path:
            return
        if not _as_at_step_end(trainer):
            log.warning("stopped: no checkpoint written (Lightning's loop state moved)")
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        log.info("stopped: %s holds step %d", self.last_model_path, trainer.global_step)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        flush_step_metrics(trainer)  # a kill after the rename must not lose this step's metrics
        target = Path(filepath)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            trainer.save_checkpoint(str(tmp), self.save_weights_only)
            if trainer.is_global_zero:
                if tmp.is_file():
                    with open(tmp, "rb+") as handle:
                        os.fsync(handle.fileno())
                elif tmp.is_dir() and target.is_dir():  # sharded (FSDP) checkpoints are folders
                    shutil.rmtree(target)
                os.replace(tmp, target)
                fsync_dir(target.parent)
        except OSError as error:
            if trainer.is_global_zero:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            raise write_error(
                target, _checkpoint_size(trainer, self.save_weights_only), error
            ) from error
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))
