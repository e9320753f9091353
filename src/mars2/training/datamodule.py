"""`TreeSearchDataModule`: streams one batch per step straight from the tree-search rollout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, IterableDataset

from mars2.generation.engine_group import engine_group_of
from mars2.training.batching import micro_batches, shuffle_seed
from mars2.training.members import is_trainable, team_members
from mars2.training.rollout import RolloutEngine, TreeBundle


class _RolloutStream(IterableDataset):
    def __init__(self, datamodule: TreeSearchDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[dict[str, Any]]:
        dm = self.datamodule
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
    """

    def __init__(self, engine: RolloutEngine, max_steps: int | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.max_steps = max_steps
        self.next_step = 0
        self.last: Any = None  # the latest StepData, for callbacks

    def _team(self) -> Any:
        if self.trainer is None:
            raise RuntimeError(
                "TreeSearchDataModule needs a trainer: the generators are the team's policies"
            )
        return self.trainer.lightning_module

    def generators(self) -> dict[str, Any]:
        return {name: agent.generator for name, agent in team_members(self._team()).items()}

    def make_batch(self, step: int) -> dict[str, Any]:
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
        self.last = data
        per_agent = {}
        for name, samples in data.samples.items():
            agent = agents[name]
            if not is_trainable(agent):
                continue  # a frozen teammate's samples shaped the others' and train nobody
            seed = shuffle_seed(self.engine.schedule.seed, step, rank, name)
            size, pad = agent.micro_batch_size, agent.tokenizer.pad_token_id
            mini = agent.optim_config.mini_batches
            per_agent[name] = micro_batches(samples, size, pad, mini, seed) if samples else []
        return {
            "step": step,
            "agents": per_agent,
            "counts": {name: len(samples) for name, samples in data.samples.items()},
            "metrics": data.metrics,
            "trees": TreeBundle(data.trees),
        }

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
