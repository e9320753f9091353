"""Progress a user can read: a training bar with a total and an ETA, a warm-start bar."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from tqdm.auto import tqdm


@contextlib.contextmanager
def warm_start_bar(agent: str, epochs: int) -> Iterator[Callable[[float], None]]:
    """A bar over one agent's warm-start epochs; yields the per-epoch callback (takes the loss)."""
    with tqdm(total=epochs, desc=f"warm start {agent}", unit="epoch", dynamic_ncols=True) as bar:

        def on_epoch(loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update(1)

        yield on_epoch


class StepProgressBar(TQDMProgressBar):
    """The training bar counts team steps out of `trainer.max_steps`, so it shows a total and an
    ETA (the rollout stream has no length, which left Lightning's bar at `17/?`). Its label is
    "Training" whether the run starts or resumes mid-epoch (Lightning's said "Epoch 0" on a
    fresh run only), and it leaves out the logger's version (`v_num`)."""

    LABEL = "Training"

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    def _done(self, trainer: pl.Trainer) -> int:
        datamodule = getattr(trainer, "datamodule", None)
        return int(getattr(datamodule, "next_step", 0) or 0)

    def _sync(self, trainer: pl.Trainer, start: bool = False) -> None:
        bar = self.train_progress_bar
        total = self.total_train_batches
        if total != float("inf") and bar.total != total:
            bar.total = int(total)
        bar.set_description(self.LABEL, refresh=False)
        done = self._done(trainer)
        if start and done:  # resumed: the bar (and its ETA) starts at the steps already done
            bar.initial = done
            bar.last_print_n = done
        bar.n = done

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed mid-epoch gets no on_train_epoch_start: the total is set here too.
        super().on_train_start(trainer, pl_module)
        self._sync(trainer, start=True)
        self.train_progress_bar.refresh()

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # Lightning's own would label the bar "Epoch 0" (printing it once) before _sync renames it.
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset()
        self.train_progress_bar.initial = 0
        self._sync(trainer, start=True)
        self.train_progress_bar.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        self._sync(trainer)
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
