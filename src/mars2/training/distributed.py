"""Multi-agent data parallelism: step sizes all-reduced and gradients summed across ranks by hand.

Each agent steps on its own nodes only, so from one step to the next a rank may have nodes for
some agents and none for others. DistributedDataParallel's hooks assume every rank runs the same
backward; instead the strategy leaves the module unwrapped and the team syncs each agent's
gradients itself: every rank normalises its loss by the all-reduced step sizes (`global_counts`)
and the gradients are summed (`sum_gradients`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_counts(local: list[int], device: torch.device) -> list[int]:
    """Per-agent sample counts summed over all ranks (the local ones when not distributed)."""
    if not is_distributed():
        return list(local)
    tensor = torch.tensor(local, dtype=torch.long, device=device)
    dist.all_reduce(tensor)
    return [int(v) for v in tensor.tolist()]


def average_gradients(module: torch.nn.Module, local_count: int, global_count: int) -> None:
    """Turn each rank's mean gradient into the sample-weighted mean over all ranks."""
    if not is_distributed():
        return
    for param in module.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.mul_(local_count)
        dist.all_reduce(param.grad)
        param.grad.div_(max(1, global_count))


def sum_gradients(module: torch.nn.Module) -> None:
    """Sum each gradient over all ranks (each rank's loss is already normalised globally)."""
    if not is_distributed():
        return
    for param in module.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)


class MultiAgentDDPStrategy(DDPStrategy):
    """DDP process launching and groups, without wrapping the team in DistributedDataParallel."""

    strategy_name = "multi_agent_ddp"

    def configure_ddp(self) -> None:
        # Parameters must still start equal on every rank.
        assert self.model is not None
        for tensor in self.model.state_dict().values():
            if isinstance(tensor, torch.Tensor):
                dist.broadcast(tensor, src=0)
