"""`TreeSearchDataModule`: streams one batch per step straight from the tree-search rollout."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from mars2.generation.engine_group import engine_group_of
from mars2.training.batching import micro_batches, shuffle_seed
from mars2.training.distributed import sum_across_ranks
from mars2.training.members import is_trainable, team_members
from mars2.training.rollout import RolloutEngine, StepData, TreeBundle
from mars2.utils.validation import staleness_error

log = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A sample was older than `max_staleness` weight updates when it reached the trainer."""


class _RolloutStream(IterableDataset):
    def __init__(self, datamodule: TreeSearchDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[dict[str, Any]]:
        dm = self.datamodule
        if dm.max_staleness > 0:
            yield from dm.in_flight_batches()
            return
        while dm.max_steps is None or dm.next_step < dm.max_steps:
            step = dm.next_step
            dm.next_step += 1  # a checkpoint written after this step resumes with the next one
            yield dm.make_batch(step)


class TreeSearchDataModule(pl.LightningDataModule):
    """Each batch: that step's problems grown into trees by the team's own generators.

    Generation needs the live policies, so the stream runs in the training process
    (``num_workers=0``) and reads the team from the trainer. The modules pull batches through
    ``training_step(dataloader_iter)``: Lightning then prefetches nothing, so step k+1 is sampled
    after step k's update (on-policy). Under DDP every rank grows its own
    slice of the step's problems; ranks sharing tensor-parallel engines grow one slice per group
    and split its samples. The next step index is part of the checkpoint, so resuming
    continues with the batch that would have come next.

    ``max_staleness=1`` (one-step off-policy, pipelined driver only): when the trainer takes step
    t's batch, step t+1's rollout starts on a background thread and runs while the trainer updates
    on step t; the callback's sync after the update lands in the middle of it (a server pauses
    with mode=keep). Every completion carries the weights version it was asked from; a sample
    more than `max_staleness` updates older than the trainer's weights when its batch is taken is
    refused (`StalenessError`: by construction it cannot happen, so one that does is a bug, not
    data to drop). The agent statistics fold in step t's trees when its batch is taken, before
    step t+1's rollout starts, as on-policy. Checkpoints hold no rollout in flight: `next_step` is
    the first step not yet handed to the trainer, and a resume regrows that step's trees from its
    prompts (a function of seed and step), so no prompt is lost and none is trained twice.
    """

    def __init__(
        self, engine: RolloutEngine, max_steps: int | None = None, max_staleness: int = 0
    ) -> None:
        super().__init__()
        error = staleness_error(
            max_staleness, getattr(getattr(engine.search, "config", None), "driver", None)
        )
        if error:
            raise ValueError(error)
        self.engine = engine
        self.max_steps = max_steps
        self.max_staleness = max_staleness
        self.next_step = 0
        self.last: Any = None  # the latest StepData, for callbacks
        self._worker: ThreadPoolExecutor | None = None
        self._flying: tuple[int, Future[tuple[StepData, dict[str, Any]]]] | None = None

    def _team(self) -> Any:
        if self.trainer is None:
            raise RuntimeError(
                "TreeSearchDataModule needs a trainer: the generators are the team's policies"
            )
        return self.trainer.lightning_module

    def generators(self) -> dict[str, Any]:
        return {name: agent.generator for name, agent in team_members(self._team()).items()}

    def make_batch(self, step: int) -> dict[str, Any]:
        data, batch = self._rollout(step)
        self.last = data
        return batch

    def _rollout(self, step: int) -> tuple[StepData, dict[str, Any]]:
        agents = team_members(self._team())
        rank = self.trainer.global_rank if self.trainer else 0
        world = self.trainer.world_size if self.trainer else 1
        overlong = {name: agent.overlong for name, agent in agents.items() if agent.overlong}
        generators = self.generators()
        group = engine_group_of(generators)  # ranks sharing tensor-parallel engines, if any
        frozen = [name for name, agent in agents.items() if not is_trainable(agent)]
        if group is None:
            data = self.engine.run(step, generators, rank, world, overlong=overlong, frozen=frozen)
        else:
            data = self.engine.run_in_group(step, generators, group, overlong=overlong,
                                            frozen=frozen)  # fmt: skip
        per_agent = {}
        for name, samples in data.samples.items():
            agent = agents[name]
            if not is_trainable(agent):
                continue  # a frozen teammate's samples shaped the others' and train nobody
            seed = shuffle_seed(self.engine.schedule.seed, step, rank, name)
            size, pad = agent.micro_batch_size, agent.tokenizer.pad_token_id
            mini = agent.optim_config.mini_batches
            per_agent[name] = micro_batches(samples, size, pad, mini, seed) if samples else []
        return data, {
            "step": step,
            "agents": per_agent,
            "counts": {name: len(samples) for name, samples in data.samples.items()},
            "metrics": data.metrics,
            "trees": TreeBundle(data.trees),
        }

    # -- in-flight updates (max_staleness > 0) ------------------------------------------------

    def fold_statistics(self, data: StepData) -> None:
        """Fold a step's trees into the agent statistics (every rank folds in the whole step's)."""
        statistics = self.engine.agent_statistics
        if statistics is not None:
            team = list(team_members(self._team()))
            statistics.update(data.trees, agents=team, reduce=sum_across_ranks)

    def _check_in_flight(self) -> None:
        world = self.trainer.world_size if self.trainer else 1
        if world > 1:
            raise ValueError(
                f"max_staleness={self.max_staleness} runs on one process only (this run has "
                f"{world}): the background rollout would issue collectives (engine groups, "
                "statistics) alongside the trainer's gradient all-reduces. Use max_staleness=0."
            )
        unsafe = {
            name: type(generator.backend).__name__
            for name, generator in self.generators().items()
            if not generator.overlaps_updates
        }
        if unsafe:
            raise ValueError(
                f"max_staleness={self.max_staleness}: the generators of {sorted(unsafe)} "
                f"({', '.join(sorted(set(unsafe.values())))}) cannot generate while the trainer "
                "updates: an in-process vLLM engine shares the trainer's GPU memory and sleeps "
                "during updates, and a transformers generator on the policy itself would sample "
                "from weights changing under it. Use generation.backend=vllm_server (weights in "
                "another process, synced with pause mode=keep) or transformers (which then gets "
                "its own copy of the weights), or max_staleness=0."
            )

    def _start(self, step: int) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="mars2-rollout")
        self._flying = (step, self._worker.submit(self._rollout, step))

    def in_flight_batches(self) -> Iterator[dict[str, Any]]:
        """One batch per step, each step's rollout overlapping the trainer's previous update."""
        self._check_in_flight()
        try:
            while self.max_steps is None or self.next_step < self.max_steps:
                step = self.next_step
                if self._flying is None or self._flying[0] != step:
                    self._drain()  # a rollout of another step (a reloaded state): not trained on
                    self._start(step)
                assert self._flying is not None
                began = time.perf_counter()
                data, batch = self._flying[1].result()
                waited = time.perf_counter() - began
                self._flying = None
                batch["metrics"] = {
                    **batch["metrics"],
                    **self._handed(data),
                    "rollout_wait_seconds": waited,
                }
                data.metrics = batch["metrics"]
                self.fold_statistics(data)  # before the next rollout reads them
                self.last = data
                self.next_step += 1  # a checkpoint after this step resumes with the next one
                if self.max_steps is None or self.next_step < self.max_steps:
                    self._start(self.next_step)  # samples while the trainer updates on `batch`
                yield batch
        finally:
            self._drain()

    def _handed(self, data: StepData) -> dict[str, float]:
        """Check the step's samples against the bound at hand-off; their staleness metrics."""
        generators = self.generators()
        metrics: dict[str, float] = {}
        for generator in generators.values():
            generator.hold_floor()  # the trainer's weights now: the last update was synced
        for name, samples in data.samples.items():
            generator = generators[name]
            ages = [generator.staleness(s.node.completion.weights_version) for s in samples]
            if ages and max(ages) > self.max_staleness:
                raise StalenessError(
                    f"agent {name!r}, step {data.step}: a sample is {max(ages)} weight updates "
                    f"older than the trainer's weights, beyond max_staleness={self.max_staleness}; "
                    "it is not trained on (a rollout ran further ahead than the bound allows)"
                )
            metrics[f"{name}/staleness_mean"] = float(np.mean(ages)) if ages else 0.0
            metrics[f"{name}/stale_share"] = float(np.mean([a > 0 for a in ages])) if ages else 0.0
        return metrics

    def settle(self) -> None:
        """Wait until no rollout is in flight, keeping its batch for the trainer: evaluation
        during training shares the generators, the grader and torch's random generator with it,
        so it runs at such a drained point."""
        if self._flying is not None:
            wait([self._flying[1]])

    def _drain(self) -> None:
        """Wait for a rollout still in flight and discard it (its step is grown again later)."""
        if self._flying is None:
            return
        step, future = self._flying
        self._flying = None
        try:
            future.result()
        except BaseException as error:  # it is discarded: its failure is not the run's
            log.warning("discarded in-flight rollout of step %d failed: %s", step, error)

    def teardown(self, stage: str) -> None:
        self._drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RolloutStream(self), batch_size=None, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"next_step": self.next_step}
        if self.engine.agent_statistics is not None:
            state["agent_statistics"] = self.engine.agent_statistics.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_step = int(state_dict["next_step"])
        if "agent_statistics" in state_dict and self.engine.agent_statistics is not None:
            self.engine.agent_statistics.load_state_dict(state_dict["agent_statistics"])
