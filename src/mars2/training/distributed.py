"""Multi-agent data parallelism: step sizes all-reduced and gradients summed across ranks by hand.

Each agent steps on its own nodes only, so from one step to the next a rank may have nodes for
some agents and none for others. DistributedDataParallel's hooks assume every rank runs the same
backward; instead the strategy leaves the module unwrapped and the team syncs each agent's
gradients itself: every rank normalises its loss by the all-reduced step sizes (`global_counts`)
and the gradients are summed (`sum_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def idle_micro_batch(agent: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """A one-row micro-batch with no completion tokens: its loss and gradients are exactly zero."""
    pad = agent.tokenizer.pad_token_id
    return {
        "input_ids": torch.full((1, 2), pad, dtype=torch.long, device=device),
        "attention_mask": torch.ones((1, 2), dtype=torch.long, device=device),
        "completion_mask": torch.zeros((1, 1), device=device),
        "advantages": torch.zeros(1, device=device),
        "truncated": torch.zeros(1, dtype=torch.bool, device=device),
        "rollout_logprobs": torch.zeros((1, 1), device=device),
        "has_rollout_logprobs": torch.zeros(1, dtype=torch.bool, device=device),
    }


def agent_step_route(
    agent: Any, backward: Callable[[torch.Tensor], Any]
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], None] | None, Callable[..., Any] | None]:
    """(backward, gradient sync, micro-batch padding) for one agent's step on this rank.

    Every rank's loss is already normalised by the step's global sizes, so the gradient wanted is
    the sum over ranks. Replicated (DDP or one process): backward as it is, gradients summed by
    hand afterwards, no padding. Sharded (FSDP2): its forwards and backwards are collectives, so
    `pad(micro_batches, spare=0)` gives every rank as many micro-batches as the busiest one (idle
    ones: no completion tokens, so zero loss and zero gradient), and backward is scaled by the
    world size because FSDP reduces gradients to their mean; FSDP itself does the reduction.
    """
    if not _is_sharded(agent.policy):
        return backward, lambda a: sum_gradients(a.policy), None
    device = next(agent.policy.parameters()).device
    idle = idle_micro_batch(agent, device)
    world = dist.get_world_size()

    def pad(
        batches: list[dict[str, torch.Tensor]], spare: int = 0
    ) -> list[dict[str, torch.Tensor]]:
        most = torch.tensor([len(batches)], dtype=torch.long, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return list(batches) + [idle] * (int(most) + spare - len(batches))

    return lambda loss: backward(loss * world), None, pad


def sum_across_ranks(values: list[float]) -> list[float]:
    """`values` summed element-wise over all ranks, in float64 (themselves when not distributed)."""
    if not is_distributed():
        return list(values)
    nccl = dist.get_backend() == "nccl"  # NCCL reduces GPU tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]
