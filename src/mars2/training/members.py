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
