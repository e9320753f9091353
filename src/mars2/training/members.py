"""Small helpers the team, the agents, the datamodule and the callbacks share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import move_data_to_device


def team_members(module: Any) -> dict[str, Any]:
    """The agents a trained module holds: a team's members, or a lone agent itself."""
    if hasattr(module, "agents"):
        return dict(module.agents)
    return {module.name: module}


def next_batch(module: pl.LightningModule, dataloader_iter: Iterator[Any]) -> dict[str, Any]:
    """Pull the next step's batch and move its tensors to the module's device."""
    batch, _, _ = next(dataloader_iter)
    return move_data_to_device(batch, module.device)


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
