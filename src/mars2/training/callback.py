"""`MultiAgentCallback`: attaches the agents' generators (and owns the run's vLLM engines), syncs
weights to them after each step, updates agent statistics, logs per-agent metrics and saves the
step's trees (as MLflow artifacts when MLflow is the logger).

Views and held-out evaluation during training live with eval (`mars2.eval.callbacks`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import MLFlowLogger
from torchmetrics import MeanMetric

from mars2.generation.engines import EnginePool
from mars2.generation.factory import build_generators
from mars2.search.tree import save_trees
from mars2.training.distributed import sum_across_ranks
from mars2.training.members import is_trainable, team_members

log = logging.getLogger(__name__)


def log_artifact(trainer: pl.Trainer, path: Path, folder: str) -> None:
    """Attach a file to the run when MLflow is the logger (other loggers keep it on disk only)."""
    logger: Any = trainer.logger
    if isinstance(logger, MLFlowLogger):  # also its subclasses (mars2.utils.tracking.RunTracker)
        logger.experiment.log_artifact(logger.run_id, str(path), artifact_path=folder)


def run_datamodule(trainer: pl.Trainer) -> Any:
    """The run's TreeSearchDataModule (Lightning sets it on the trainer at fit time)."""
    return getattr(trainer, "datamodule", None)


def _driver(trainer: pl.Trainer) -> str | None:
    """The rollout driver of the run's search (`search.config.driver`), when there is one."""
    search = getattr(getattr(run_datamodule(trainer), "engine", None), "search", None)
    return getattr(getattr(search, "config", None), "driver", None)


def _max_staleness(trainer: pl.Trainer) -> int:
    """The run's bound on sample staleness (`TreeSearchDataModule.max_staleness`; 0: on-policy)."""
    return int(getattr(run_datamodule(trainer), "max_staleness", 0) or 0)


class MultiAgentCallback(pl.Callback):
    """Coordinates the team around each optimisation step."""

    def __init__(
        self, output_dir: str, save_trees_every: int = 1, save_final_agents: bool = True
    ) -> None:
        super().__init__()
        self.output_dir = Path(output_dir)
        self.save_trees_every = save_trees_every
        self.save_final_agents = save_final_agents
        self._running: dict[str, MeanMetric] = {}
        self._pool: EnginePool | None = None
        self._attached: list[str] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give every agent without a generator one, serving its current weights."""
        agents = team_members(pl_module)
        in_flight = _max_staleness(trainer) > 0  # generation overlaps the trainer's updates
        for agent in agents.values():  # their samples may come from older weights: TIS corrects
            agent.off_policy_samples = in_flight
        missing = {name: agent for name, agent in agents.items() if not agent.has_generator}
        if not missing:
            return
        self._pool = EnginePool(log_dir=self.output_dir / "servers")
        streaming = _driver(trainer) == "pipelined"  # vLLM engines then take requests as they come
        built = build_generators(missing, self._pool, streaming=streaming, in_flight=in_flight)
        for name, generator in built.items():
            agents[name].generator = generator
        self._attached = list(missing)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed run has just loaded its checkpoint: the generators take those weights.
        for agent in team_members(pl_module).values():
            agent.generator.catch_up()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Detach the generators this callback built and close the run's engines."""
        agents = team_members(pl_module)
        for name in self._attached:
            agents[name].generator = None
        self._attached = []
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _running_mean(self, key: str, value: float) -> float:
        metric = self._running.setdefault(key, MeanMetric())
        metric.update(value)
        return float(metric.compute())

    def state_dict(self) -> dict[str, Any]:  # in checkpoints: running means survive a resume
        return {
            "running": {k: (float(m.mean_value), float(m.weight)) for k, m in self._running.items()}
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, (total, weight) in state_dict.get("running", {}).items():
            if weight:
                self._running.setdefault(key, MeanMetric()).update(total / weight, weight=weight)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        datamodule = run_datamodule(trainer)
        data = getattr(datamodule, "last", None)
        if data is None:
            return
        # Every agent whose optimizer stepped (on any rank) serves its new weights from now on.
        for agent in team_members(pl_module).values():
            agent.generator.catch_up()
        statistics = datamodule.engine.agent_statistics
        # In-flight updates fold them in when the batch is taken, before the next rollout starts.
        if statistics is not None and not _max_staleness(trainer):  # every rank: the whole step
            team = list(team_members(pl_module))
            statistics.update(data.trees, agents=team, reduce=sum_across_ranks)
        running = {}
        for name in team_members(pl_module):
            for key in ("reward_mean", "solve_rate", "expansion_share"):
                value = data.metrics.get(f"{name}/{key}")
                if value is not None:
                    running[f"{name}/{key}_running"] = self._running_mean(f"{name}/{key}", value)
        pl_module.log_dict(running, batch_size=1)
        if self.save_trees_every and data.number % self.save_trees_every == 0:
            self._save_trees(trainer, data)

    def _save_trees(self, trainer: pl.Trainer, data: Any) -> None:
        name = f"step_{data.number:06d}_rank{trainer.global_rank}.jsonl"  # as the checkpoint's
        path = self.output_dir / "trees" / name
        save_trees(data.trees, path)
        log_artifact(trainer, path, "trees")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0 or not self.save_final_agents:
            return
        for name, agent in team_members(pl_module).items():
            if not is_trainable(agent):
                continue  # a frozen teammate's weights are where they came from
            target = self.output_dir / "agents" / name
            agent.save_pretrained(str(target))
            log.info("saved agent %s to %s", name, target)
