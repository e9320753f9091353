"""Small helpers the team, the agents, the datamodule and the callbacks share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import move_data_to_device

from mars2.generation.factory import ServedGenerator


def team_members(module: Any) -> dict[str, Any]:
    """The agents of a trained module, frozen teammates included, in the configured order: a
    team's members, or a lone agent itself."""
    if hasattr(module, "members"):
        return dict(module.members())
    if hasattr(module, "agents"):
        return dict(module.agents)
    return {module.name: module}


def is_trainable(agent: Any) -> bool:
    """False for a frozen teammate (``trainable: false``), True for every trained agent."""
    return bool(getattr(agent, "trainable", True))


def next_batch(module: pl.LightningModule, dataloader_iter: Iterator[Any]) -> dict[str, Any]:
    """Pull the next step's batch and move its tensors to the module's device."""
    batch, _, _ = next(dataloader_iter)
    return move_data_to_device(batch, module.device)


class GeneratorSlot:
    """The generator an agent (trained or frozen) is served by, attached by the run.

    Needs `name` and `weights_version` on the class it is mixed into.
    """

    name: str
    weights_version: int
    _generator: ServedGenerator | None = None

    @property
    def has_generator(self) -> bool:
        return self._generator is not None

    @property
    def generator(self) -> ServedGenerator:
        """The generator serving this agent, attached by the run (see mars2.generation.factory)."""
        if self._generator is None:
            raise RuntimeError(
                f"agent {self.name!r} has no generator: a training run's MultiAgentCallback "
                "attaches them at setup; elsewhere use mars2.generation.factory.build_generators"
            )
        return self._generator

    @generator.setter
    def generator(self, value: Any) -> None:
        """Attach a generator; a bare backend is taken to serve the current weights."""
        if value is None or isinstance(value, ServedGenerator):
            self._generator = value
        else:
            self._generator = ServedGenerator(self, value, served_version=self.weights_version)  # type: ignore[arg-type]


def forget_earlier_steps(module: pl.LightningModule) -> None:
    """Make `training_step`'s logged metrics this step's alone (call it before logging any).

    Lightning keeps a value logged in `training_step` until the epoch ends, and a run here is one
    epoch: an agent that sits a step out would log its previous step's loss, lr, tokens... again
    at that step, and a run resumed at that step (which never saw the previous one) would not, so
    the histories of an interrupted and an uninterrupted run would differ. Uses Lightning 2.x's
    result collection (private); without one (no trainer) there is nothing to forget.
    """
    trainer = getattr(module, "_trainer", None)
    results = getattr(trainer, "_results", None) if trainer is not None else None
    if results is not None:
        results.reset(fx="training_step")
