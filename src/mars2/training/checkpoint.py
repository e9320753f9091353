"""Checkpoints that survive a full disk."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

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
