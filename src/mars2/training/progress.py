"""Progress a user can read: a training bar with a total and an ETA, a warm-start bar; without
a terminal (a batch job, a pipe) one log line per step and per warm-start epoch instead, which a
log file holds (the run's ``train.log`` gets them through the logging setup)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)


def interactive() -> bool:
    """Whether progress goes to a terminal (bars) or to a log (lines); tqdm writes to stderr."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def warm_start_bar(agent: str, epochs: int) -> Iterator[Callable[[float], None]]:
    """A bar over one agent's warm-start epochs; yields the per-epoch callback (takes the loss)."""
    if not interactive():
        done = iter(range(1, epochs + 1))
        started = time.monotonic()

        def on_line(loss: float) -> None:
            epoch = next(done, epochs)
            log.info(
                "warm start %s: epoch %d/%d, loss %.4f, %.1f s",
                agent, epoch, epochs, loss, time.monotonic() - started,
            )  # fmt: skip

        yield on_line
        return
    bar = tqdm(total=epochs, desc=f"warm start {agent}", unit="epoch", dynamic_ncols=True)
    # A log line while the bar is up is written above it (not glued to its last frame).
    with logging_redirect_tqdm(), bar:

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

    def __init__(self, *args: Any, lines: bool | None = None, **kwargs: Any) -> None:
        """`lines`: one log line per step instead of a bar (None: when stderr is no terminal)."""
        self.lines = not interactive() if lines is None else lines
        super().__init__(*args, **kwargs)
        self._started = time.monotonic()
        self._redirect: contextlib.ExitStack | None = None
        if self.lines:
            self.disable()

    def step_line(self, trainer: pl.Trainer) -> str:
        """`step 3/20: reward 0.42, solve rate 0.50, loss tiny_qwen3 0.123 tiny_llama 0.456, 12.3 s`"""
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        total = self.total_train_batches
        of = f"/{int(total)}" if total != float("inf") else ""
        parts = [f"step {self._done(trainer)}{of}"]
        if "reward" in metrics:
            parts.append(f"reward {metrics['reward']:.3f}")
        if "solve_rate" in metrics:
            parts.append(f"solve rate {metrics['solve_rate']:.3f}")
        losses = [
            f"{k.split('/', 1)[0]} {v:.4f}" for k, v in metrics.items()
            if k.endswith("/loss") and k.count("/") == 1
        ]  # fmt: skip
        if losses:
            parts.append("loss " + " ".join(losses))
        parts.append(f"{time.monotonic() - self._started:.1f} s")
        return ", ".join(parts)

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    def _done(self, trainer: pl.Trainer) -> int:
        datamodule = getattr(trainer, "datamodule", None)
        return int(getattr(datamodule, "next_step", 0) or 0)

    def _sync(self, trainer: pl.Trainer, start: bool = False) -> None:
        # The total and label are set where the bar is made (init_train_tqdm); only its count moves.
        bar = self.train_progress_bar
        done = self._done(trainer)
        if start and done:  # resumed: the bar (and its ETA) starts at the steps already done
            bar.initial = done
            bar.last_print_n = done
        bar.n = done

    def init_train_tqdm(self) -> Tqdm:
        # Lightning's bar is drawn at creation, before its total is known ("Training 0/?"): this
        # one is born with its total and label.
        total = self.total_train_batches
        return Tqdm(
            desc=self.LABEL,
            total=None if total == float("inf") else int(total),
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed mid-epoch gets no on_train_epoch_start: its count is set here too.
        self._started = time.monotonic()
        if not self.lines and self._redirect is None:
            # Log lines (Lightning's, ours) while the bar is up are written above it, never glued
            # to its last frame, so the terminal shows the bar once.
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())
        super().on_train_start(trainer, pl_module)  # with `lines`, the bar is disabled: silent
        self._sync(trainer, start=True)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # Lightning's own would label the bar "Epoch 0" (printing it once) before _sync renames it.
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self._sync(trainer, start=True)
        self.train_progress_bar.refresh()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._stop_redirect()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not self.lines:
            self.train_progress_bar.close()
        self._stop_redirect()

    def _stop_redirect(self) -> None:
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        self._sync(trainer)
        if self.lines:
            log.info("%s", self.step_line(trainer))
            return
        bar = self.train_progress_bar
        bar.set_postfix(self.get_metrics(trainer, pl_module))
        if bar.total is not None and bar.n >= bar.total:
            # The last step: closed now, its final frame printed once, before the end-of-run
            # lines (Lightning's close at on_train_end would draw it again below them).
            bar.close()
