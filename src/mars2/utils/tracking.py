"""An MLflow logger that continues the run of its run folder and leaves no run `RUNNING` forever.

- The run folder's `mlflow_run.json` names its MLflow run, so a resumed command (same folder, see
  `mars2.utils.runs`) logs into the same run, tagged `mars2.resumes`.
- A resumed run re-does the steps after its checkpoint; a (metric, step) pair already in the run
  is not logged again, so the history holds every step once.
- Runs of this experiment still `RUNNING` whose process is gone (killed, crashed machine) are
  marked `KILLED` when a later command starts; a run stopped by SIGTERM or Ctrl-C ends `KILLED`,
  by an exception `FAILED`, otherwise `FINISHED`.
- Metric names are made acceptable to MLflow up front (`pass@1` -> `pass_at_1`), without the
  rename warnings Lightning's logger prints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger

from mars2.utils.atomic import atomic_write_text

log = logging.getLogger(__name__)

RECORD = "mlflow_run.json"
log = logging.getLogger(__name__)
_REPLACEMENTS = (("@", "_at_"), ("+", "_"), ("(", "_"), (")", ""))


def metric_key(name: str) -> str:
    """`name` in the characters MLflow accepts (letters, digits, `_ - . / ` and space)."""
    for old, new in _REPLACEMENTS:
        name = name.replace(old, new)
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_record(run_dir: Path | None, tracking_uri: str | None) -> dict[str, Any] | None:
    if run_dir is None or not (run_dir / RECORD).is_file():
        return None
    try:
        record = json.loads((run_dir / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if record.get("tracking_uri") == tracking_uri else None


# MLflow's SQL stores keep a run's name in a 250-character column.
MAX_RUN_NAME = 250


def _sweep_run_name(name: str | None) -> str | None:
    """A ``-m`` sweep's job gets its overrides in its run name (``.../seed=2,trainer=cpu``): the
    jobs of one sweep would otherwise share one name. Every override of the job is named (not
    Hydra's ``override_dirname``, which ``exclude_keys`` may thin out), and a name over
    `MAX_RUN_NAME` keeps its head and ends with the job's number, so that it stays unique."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return name
        hydra_cfg = HydraConfig.get()
        number = hydra_cfg.job.num
        label = ",".join(sorted(str(o) for o in hydra_cfg.overrides.task)) or f"job{number}"
    except (ImportError, ValueError, AttributeError):
        return name
    full = f"{name}/{label}" if name else label
    if len(full) <= MAX_RUN_NAME:
        return full
    tail = f"...#{number}"
    return full[: MAX_RUN_NAME - len(tail)] + tail


class RunTracker(MLFlowLogger):
    """`MLFlowLogger` bound to a run folder (see the module docstring)."""

    def __init__(self, *args: Any, run_dir: str | None = None, **kwargs: Any) -> None:
        self.run_dir = Path(run_dir) if run_dir else None
        record = _read_record(self.run_dir, kwargs.get("tracking_uri"))
        self.resumed = bool(record) and not kwargs.get("run_id")
        if self.resumed and record is not None:
            kwargs["run_id"] = record["run_id"]
        kwargs["run_name"] = _sweep_run_name(kwargs.get("run_name"))
        super().__init__(*args, **kwargs)
        self._logged: dict[int, set[str]] = {}  # step -> metric names already in the run
        self._params: dict[str, str] = {}
        self._started = False

    @property
    def experiment(self) -> Any:
        client = MLFlowLogger.experiment.fget(self)  # type: ignore[attr-defined]
        if self._initialized and not self._started:
            self._started = True
            self._start(client)
        return client

    def _start(self, client: Any) -> None:
        run_id = self._run_id
        mark_stale_runs(client, self._experiment_id, keep=run_id)
        run = client.get_run(run_id)
        command = " ".join(sys.argv)[:4000]
        tags = {"mars2.pid": str(os.getpid()), "mars2.host": socket.gethostname()}
        if not self.resumed:
            tags["mars2.command"] = command  # the launch command, kept as it was on resume
        if self.run_dir is not None:
            tags["mars2.run_dir"] = str(self.run_dir)
        if self.resumed:
            previous = run.info.status
            client.update_run(run_id, status="RUNNING")
            count = int(run.data.tags.get("mars2.resumes", "0")) + 1
            tags["mars2.resumes"] = str(count)
            tags[f"mars2.command_resume_{count}"] = command  # each resume's command, appended
            tags[f"mars2.attempt_{count - 1}_ended"] = (
                "KILLED" if previous == "RUNNING" else str(previous)
            )
            self._params = dict(run.data.params)
            for key in run.data.metrics:
                for point in client.get_metric_history(run_id, key):
                    self._logged.setdefault(int(point.step), set()).add(key)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        if self.run_dir is not None:
            atomic_write_text(
                self.run_dir / RECORD,
                json.dumps({"run_id": run_id, "tracking_uri": self._tracking_uri}) + "\n",
            )

    def log_hyperparams(self, params: Any) -> None:
        _ = self.experiment
        if isinstance(params, Mapping) and self._params:
            # MLflow refuses to change a logged param: a resumed run keeps the first values and
            # notes the ones that differ as tags.
            fresh = {k: v for k, v in params.items() if k not in self._params}
            for key, value in params.items():
                if key in self._params and str(value)[:250] != self._params[key]:
                    self.experiment.set_tag(self.run_id, f"mars2.resumed.{key}"[:250], str(value))
            params = fresh
        if params:
            super().log_hyperparams(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        _ = self.experiment
        at = int(step or 0)
        seen = self._logged.setdefault(at, set())
        clean = {}
        for key, value in metrics.items():
            name = metric_key(key)
            if name in seen:
                continue  # a step redone after a resume: the history keeps its first value
            clean[name] = value
        for old in [s for s in self._logged if s < at - 1]:  # steps only move forward
            del self._logged[old]
        if clean:
            self._sync_pending()
            try:
                super().log_metrics(clean, step)
            except Exception as error:  # the store is locked or unreachable: keep, sync later
                if self._landed(next(iter(clean)), at):
                    seen.update(clean)
                    return
                self._keep(clean, at, error)
                seen.update(clean)
                return
            except BaseException:  # e.g. Ctrl-C: the flush that follows retries what did not land
                if self._landed(next(iter(clean)), at):
                    seen.update(clean)
                raise
            seen.update(clean)

    # Metrics the tracking store refused (sqlite locked by another writer, a server that refuses
    # connections): written to <run folder>/metrics_pending.jsonl and sent, in order, with the
    # next metrics the store takes (or at the end of the run); never a silent gap.
    PENDING = "metrics_pending.jsonl"

    def _pending_path(self) -> Path | None:
        return self.run_dir / self.PENDING if self.run_dir is not None else None

    def _keep(self, metrics: Mapping[str, float], step: int, error: Exception) -> None:
        path = self._pending_path()
        if path is None:
            raise error
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n")
        log.warning(
            "MLflow store %s refused the metrics of step %d (%s: %s); the run goes on and keeps "
            "them in %s, sent when the store takes metrics again",
            self._tracking_uri, step, type(error).__name__, str(error).splitlines()[0][:200], path,
        )  # fmt: skip

    def _sync_pending(self) -> bool:
        """Send the kept metrics; True when none are left."""
        path = self._pending_path()
        if path is None or not path.exists():
            return True
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
        for index, row in enumerate(rows):
            try:
                MLFlowLogger.log_metrics(self, row["metrics"], row["step"])
            except Exception:
                left = "".join(json.dumps(r) + "\n" for r in rows[index:])
                path.write_text(left, encoding="utf-8")
                return False
        path.unlink()
        log.info("MLflow store is back: %d kept metric row(s) synced", len(rows))
        return True

    def _landed(self, name: str, step: int) -> bool:
        """Whether `name` at `step` is in the run (one batch of metrics is written at once)."""
        try:
            history = self.experiment.get_metric_history(self.run_id, name)
        except Exception:  # cannot tell: a retry may then log the point twice, never lose it
            return False
        return any(int(point.step) == step for point in history)

    def finalize(self, status: str = "success") -> None:
        if not self._sync_pending():
            log.warning(
                "MLflow store %s still refuses metrics at the end of the run: they stay in %s "
                "(rerun with resume=true to send them, or import that file)",
                self._tracking_uri, self._pending_path(),
            )  # fmt: skip
        if status == "failed" and isinstance(sys.exc_info()[1], KeyboardInterrupt | SystemExit):
            status = "KILLED"  # Ctrl-C, or SIGTERM (Lightning raises SIGTERMException)
        super().finalize(status)


def tracker_lines(logger: Any) -> list[str]:
    """Where a run's MLflow record is, for the list of what a command wrote."""
    if not isinstance(logger, MLFlowLogger) or not getattr(logger, "_initialized", False):
        return []
    uri = getattr(logger, "_tracking_uri", None) or "the default tracking URI"
    return [f"  {'MLflow':<12} run {logger.run_id} in {uri} (mlflow ui --backend-store-uri {uri})"]


def mark_stale_runs(client: Any, experiment_id: str | None, keep: str | None = None) -> list[str]:
    """Mark `KILLED` the runs of this experiment left `RUNNING` by a process of this machine that
    no longer exists; returns their ids."""
    if experiment_id is None:
        return []
    host = socket.gethostname()
    marked = []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'"):
        tags = run.data.tags
        if run.info.run_id == keep or tags.get("mars2.host") != host:
            continue
        pid = tags.get("mars2.pid", "")
        if pid.isdigit() and not _alive(int(pid)):
            client.set_terminated(run.info.run_id, "KILLED")
            marked.append(run.info.run_id)
    return marked


@contextlib.contextmanager
def tracked(logger: Any) -> Iterator[None]:
    """Run a block outside Lightning (evaluation) so the logger's run ends FINISHED, FAILED, or
    KILLED (SIGTERM is turned into SystemExit so the run is closed before the process exits)."""
    with closed_on_failure(logger):
        yield
    if logger:
        logger.finalize("success")


@contextlib.contextmanager
def closed_on_failure(logger: Any) -> Iterator[None]:
    """Building a training run (warm start included) outside Lightning: an exception ends the
    logger's run FAILED, SIGTERM or Ctrl-C ends it KILLED (SIGTERM becomes SystemExit(143) so the
    run is closed before the process exits); on success the run stays open for the trainer."""

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    except BaseException:
        if logger:
            logger.finalize("failed")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def set_run_tag(logger: Any, key: str, value: str) -> None:
    """Tag the logger's MLflow run (nothing for other loggers, or when MLflow cannot be reached:
    a tag never stops a run)."""
    if not isinstance(logger, MLFlowLogger):
        return
    try:
        logger.experiment.set_tag(logger.run_id, key, value)
    except Exception:
        log.warning("could not tag the MLflow run with %s", key)


def flush_step_metrics(trainer: Any) -> None:
    """Send this step's logged metrics to the run trackers now, before a checkpoint is written.

    Lightning writes a checkpoint in `on_train_batch_end` and sends the step's metrics to the
    loggers only afterwards: a kill in between leaves a checkpoint whose last step never reaches
    MLflow, and the resumed run starts after it. Logged here first, the loop's own call later is
    a repeat that `RunTracker` skips. Uses the logger connector's private state (Lightning 2.x);
    on any surprise it does nothing and the usual flush still happens.
    """
    trackers = [lg for lg in getattr(trainer, "loggers", []) if isinstance(lg, RunTracker)]
    if not trackers:  # every rank computes (symmetric if a metric syncs), rank zero logs
        return
    try:
        from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

        metrics = convert_tensors_to_scalars(dict(trainer._logger_connector.metrics["log"]))
        step = metrics.pop("step", None)
        if step is None:
            metrics.setdefault("epoch", trainer.current_epoch)
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
    except Exception:  # private API moved: keep Lightning's own (later) flush only
        return
    if metrics:
        for tracker in trackers:
            tracker.log_metrics(metrics, step=int(step))
