"""Checkpoints that survive a full disk, and a training progress bar with a total and an ETA."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

from mars2.utils.atomic import fsync_dir, write_error

log = logging.getLogger(__name__)


def _checkpoint_size(trainer: pl.Trainer, weights_only: bool) -> int | None:
    """Bytes the checkpoint takes once serialised (only asked for after a failed write)."""
    try:
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.tell()
    except Exception:  # the size is a courtesy in an error message; never mask the real error
        return None


class AtomicModelCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that writes `<name>.tmp`, fsyncs it and renames it over `<name>`.

    A write that fails midway (full disk, quota, lost mount) leaves the previous `last.ckpt`
    complete and loadable, and the error says how much space the checkpoint needs. Files of a
    step redone after a resume replace the old ones (no `-v1` copies).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
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


class StepProgressBar(TQDMProgressBar):
    """The training bar counts team steps out of `trainer.max_steps`, so it shows a total and an
    ETA (the rollout stream has no length, which left Lightning's bar at `17/?`)."""

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    def _done(self, trainer: pl.Trainer) -> int:
        datamodule = getattr(trainer, "datamodule", None)
        return int(getattr(datamodule, "next_step", 0) or 0)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        done = self._done(trainer)
        if done:  # resumed: start the bar (and its ETA) at the steps already done
            bar = self.train_progress_bar
            bar.initial = done
            bar.n = done
            bar.last_print_n = done
            bar.refresh()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        bar = self.train_progress_bar
        bar.n = self._done(trainer)
        bar.set_postfix(self.get_metrics(trainer, pl_module))
        bar.refresh()
