"""The server side of our CPU weight-transfer backend, loaded by vLLM as a general plugin.

vLLM's weight-transfer protocol (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) moves the trainer's tensors with a backend
registered on ``WeightTransferEngineFactory``; vLLM ships NCCL and CUDA IPC, neither of which
runs on CPU. `register` (the ``vllm.general_plugins`` entry point ``mars2_gloo``, run by vLLM in
every process it starts) adds ``gloo``: a two-party torch.distributed gloo group, rank 0 the
trainer (`mars2.generation.weight_transfer.GlooSender`), the engine's worker rank 1, each tensor
broadcast from the trainer in the order the update names it and loaded with vLLM's layerwise
reload, exactly as the NCCL engine does. This module runs inside the vLLM server only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from mars2.generation.weight_transfer import BACKEND, broadcast, open_group


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    world_size: int = 2
    rank_offset: int = 1
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have one entry per tensor")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives full tensors by gloo broadcast and loads them layerwise (CPU engines)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        tp_rank = self.parallel_config.rank if hasattr(self.parallel_config, "rank") else 0
        self.group = open_group(init_info.master_address, init_info.master_port,
                                init_info.rank_offset + int(tp_rank), init_info.world_size,
                                init_info.timeout_s)  # fmt: skip

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises an accelerator afterwards; gloo on CPU is synchronous
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init first")
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
            broadcast(self.group, weight)
            self.model.load_weights([(name, weight)])
            del weight

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``--weight-transfer-config
    '{"backend": "gloo"}'`` available (idempotent: vLLM runs plugins once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
