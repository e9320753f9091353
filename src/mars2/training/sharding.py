"""Sharded training of the team: PyTorch FSDP2 (`fully_shard`) applied per agent.

Each agent's policy (and its frozen KL reference) is sharded over all ranks, decoder layer by
decoder layer, so weights, gradients and optimizer states take 1/world of their size per GPU. A
LoRA agent's frozen bf16 base is sharded the same way, its adapters train (the base with the
adapter off is its reference). A bitsandbytes 4-bit (QLoRA) base cannot be sharded: FSDP2 turns
its packed `Params4bit` into plain tensors without their quantisation state. The team keeps one
optimizer per agent, built after sharding. FSDP2 runs every forward and backward
as a collective, so all ranks must run the same passes; `distributed.agent_step_route` pads an
agent's micro-batches with idle ones (zero loss) where a rank has fewer, and scales each rank's
backward by the world size: losses are normalised by the step's global sizes, so the gradient
wanted is the sum over ranks, while FSDP reduces to the mean.

Generation with the transformers backend runs uneven numbers of forwards per rank, so such agents
are gathered (unsharded, no collectives in forward) outside their training passes and released
by the first forward that records gradients. vLLM agents generate from their engine; their
weights are read with `full_state_dict` on every rank.

Checkpoints are directories written with torch.distributed.checkpoint: every rank saves its own
shards of the trained parameters (a LoRA agent's adapters, never its frozen base) and optimizer
states, rank 0 the loop/scheduler/datamodule state (`meta.pt`); resume loads them back sharded.
Works on CPU (gloo) and GPU (NCCL), unlike Lightning's FSDPStrategy, which needs a GPU.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from mars2.training.distributed import MultiAgentDDPStrategy

META_FILE = "meta.pt"
# Checkpoints hold what trains: frozen bases come from the model path again at start-up.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
# Models whose units are all-gathered and kept whole (see `gather`).
_GATHERED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def fsdp_units(module: torch.nn.Module) -> list[FSDPModule]:
    """Every FSDP-managed submodule, in module order (the same on every rank)."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names of a Hugging Face model's decoder layers (its `_no_split_modules`)."""
    names: set[str] = set()
    for sub in model.modules():
        names.update(getattr(sub, "_no_split_modules", None) or [])
    return names


def shard_model(model: torch.nn.Module, mesh: Any, reshard_after_forward: bool = True) -> None:
    """`fully_shard` every decoder layer, then the rest of the model as one unit."""
    layers = _layer_classes(model)
    for sub in model.modules():
        if type(sub).__name__ in layers:
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if hasattr(model, "peft_config"):
        # peft's generate runs the wrapped model's forward, never the root's: FSDP would then take
        # the first decoder layer for the root. Settle the root now, as a first forward would.
        cast(Any, model)._get_fsdp_state()._lazy_init()


def gather(model: torch.nn.Module) -> None:
    """All-gather every unit and keep it whole, so forwards need no collectives (idempotent)."""
    if model in _GATHERED:
        return
    for unit in fsdp_units(model):
        unit.set_reshard_after_forward(False)
        unit.unshard()
    _GATHERED.add(model)


def release(model: torch.nn.Module) -> None:
    """Back to shards only (local, no communication)."""
    if model not in _GATHERED:
        return
    for unit in fsdp_units(model):
        unit.reshard()
        unit.set_reshard_after_forward(True)
    _GATHERED.discard(model)


def _release_before_training_forward(module: torch.nn.Module, args: Any) -> None:
    if torch.is_grad_enabled():
        release(module)


def full_state_dict(
    model: torch.nn.Module, names: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs of a possibly sharded model (those in `names` when given), one
    tensor gathered at a time; every rank must iterate it."""
    for name, tensor in model.state_dict().items():
        if names is not None and name not in names:
            continue
        full = getattr(tensor, "full_tensor", None)
        yield name, full() if full is not None else tensor


# How far a rank's local bytes may sit from the plan's full / world (FSDP2 splits dim 0 in
# ceil-sized chunks: uneven rows put a few percent more on the first ranks of a tiny model).
SHARD_BYTES_TOLERANCE = 0.05


def sharding_problems(model: torch.nn.Module, world_size: int, what: str) -> list[str]:
    """What contradicts the memory plan's "divided by the world size" for `model` on this rank:
    parameters that are not sharded DTensors, or local bytes away from full / world by more than
    `SHARD_BYTES_TOLERANCE` (every parameter counts: the plan shards the frozen LoRA base, the
    adapters and the references alike; see `mars2.models.memory`)."""
    from torch.distributed.tensor import DTensor, Shard

    problems: list[str] = []
    unsharded: list[str] = []
    full = local = 0
    for name, p in model.named_parameters():
        size = p.element_size()
        full += p.numel() * size
        if not isinstance(p, DTensor) or not any(isinstance(x, Shard) for x in p.placements):
            unsharded.append(name)
            local += p.numel() * size
            continue
        local += p.to_local().numel() * size
    if unsharded:
        shown = ", ".join(unsharded[:3]) + (f" (+{len(unsharded) - 3} more)" if len(unsharded) > 3 else "")  # fmt: skip
        problems.append(f"{what}: {len(unsharded)} parameter(s) are not sharded DTensors: {shown}")
    planned = full / max(world_size, 1)
    if full and abs(local - planned) > SHARD_BYTES_TOLERANCE * planned:
        problems.append(
            f"{what}: this rank holds {local / 2**20:.2f} MiB of parameters, the plan "
            f"{planned / 2**20:.2f} MiB (full {full / 2**20:.2f} MiB / world {world_size})"
        )
    return problems


def verify_sharded(agent: Any, world_size: int) -> None:
    """After sharding, on every rank: refuse to start when an agent's policy or reference is not
    sharded as the memory plan assumes (an unsharded 32B LoRA base is 61 GiB per GPU, not 7.6)."""
    problems = sharding_problems(agent.policy, world_size, f"agent {agent.name} policy")
    for i, reference in enumerate(getattr(agent, "_reference", [])):
        problems += sharding_problems(reference, world_size, f"agent {agent.name} reference {i}")
    if problems:
        raise RuntimeError(
            "trainer=fsdp: the memory plan divides every weight, gradient and optimizer state of "
            "a sharded agent by the world size, but after setup " + "; ".join(problems) + ". "
            "The run stops before its first step because it would need up to world-size times "
            "more memory per GPU than the check allowed; shard the agent with "
            "`mars2.training.sharding.shard_model` (every decoder layer, then the root), or train "
            "it under trainer=ddp with the memory check's replicated plan."
        )


def shard_agent(agent: Any, mesh: Any, world_size: int) -> None:
    """Shard an agent's policy and references (FSDP2), then verify them against the plan."""
    check_shardable(agent)
    shard_model(agent.policy, mesh)
    for reference in getattr(agent, "_reference", []):
        shard_model(reference, mesh)
    verify_sharded(agent, world_size)


def _adapter_names(policy: torch.nn.Module) -> set[str]:
    return {name for name, p in policy.named_parameters() if p.requires_grad}


def _agents(team: torch.nn.Module) -> dict[str, Any]:
    found: Any = team
    return dict(found.agents) if hasattr(found, "agents") else {found.name: found}


def check_shardable(agent: Any) -> None:
    """trainer=fsdp shards full fine-tuning and LoRA on a 16/32-bit base; say what to use else."""
    spec, optim = agent.model_spec, agent.optim_config
    if spec.quantization:
        raise ValueError(
            f"agent {agent.name}: trainer=fsdp cannot shard a bitsandbytes {spec.quantization} "
            "base (FSDP2 gathers its packed weights back without their quantisation state, so "
            "the forward would be wrong); train QLoRA agents under trainer=ddp, or shard a LoRA "
            "agent on its bf16 base under trainer=fsdp (scale.quantization=null)"
        )
    if optim.optimizer == "adamw8bit":
        raise ValueError(
            f"agent {agent.name}: bitsandbytes AdamW8bit cannot step sharded (DTensor) parameters; "
            "use optim.optimizer=adamw under trainer=fsdp"
        )


class _ExportFullWeights(pl.Callback):
    """On every rank before the final agents are saved: gather full weights and hand them to the
    policy's `save_pretrained` on rank 0 (a sharded state_dict holds only this rank's shards)."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for agent in _agents(pl_module).values():
            policy = agent.policy
            if not is_sharded(policy):
                continue
            release(policy)
            # every rank takes part in each gather; only rank 0, which saves, keeps the tensors.
            # A LoRA (peft) policy saves its adapter only: only those are gathered.
            keep = _adapter_names(policy) if hasattr(policy, "peft_config") else None
            state = {
                k: v.detach().cpu()
                for k, v in full_state_dict(policy, keep)
                if trainer.is_global_zero
            }
            if trainer.is_global_zero:
                original = type(policy).save_pretrained.__get__(policy)
                policy.save_pretrained = functools.partial(original, state_dict=state)


class MultiAgentFSDPStrategy(MultiAgentDDPStrategy):
    """DDP process launching, with every agent's policy and reference sharded by FSDP2."""

    strategy_name = "multi_agent_fsdp"

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint is loaded into the sharded modules and optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` restores them itself

    def setup(self, trainer: pl.Trainer) -> None:
        cast(Any, trainer).callbacks.insert(0, _ExportFullWeights())
        super().setup(trainer)

    def model_to_device(self) -> None:
        pass  # fully_shard moves each rank's shards; the whole model never lands on one device

    def configure_ddp(self) -> None:
        assert self.model is not None
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        for agent in _agents(self.model).values():
            shard_agent(agent, mesh, self.world_size)
            if agent.generation_config.backend == "transformers":
                agent.policy.register_forward_pre_hook(
                    _release_before_training_forward, prepend=True
                )
        self.model.to(self.root_device)
        # Not gathered yet: the optimizers, built next, must hold the sharded parameters.

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._regather()  # for this step's rollouts
        output = super().training_step(*args, **kwargs)
        self._regather()  # ready for the next rollouts and held-out evaluation
        return output

    # -- sharded checkpoints ----------------------------------------------------------------

    def _release_all(self) -> None:
        assert self.model is not None
        for agent in _agents(self.model).values():
            release(agent.policy)

    def _regather(self) -> None:
        assert self.model is not None
        for agent in _agents(self.model).values():
            if agent.generation_config.backend == "transformers":
                gather(agent.policy)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        self._release_all()  # shards are what is saved; gathered again in save_checkpoint
        return get_model_state_dict(self.model, options=TRAINED_ONLY)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.model is not None
        self._release_all()
        return get_optimizer_state_dict(self.model, optimizer, options=TRAINED_ONLY)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        path = Path(filepath)
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        meta = dict(checkpoint)
        tensors = {
            "state_dict": meta.pop("state_dict"),
            "optimizer_states": {str(i): s for i, s in enumerate(meta.pop("optimizer_states", []))},
        }
        dcp.save(tensors, checkpoint_id=path)
        if self.is_global_zero:
            torch.save(meta, path / META_FILE)
        self.barrier("save_checkpoint")
        self._regather()

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if not (path / META_FILE).is_file():
            raise FileNotFoundError(
                f"{path} is not a sharded checkpoint of trainer=fsdp (no {META_FILE}); "
                "resume a trainer=ddp checkpoint with trainer=ddp"
            )
        assert self.model is not None
        self._release_all()
        optimizers = list(self.optimizers)
        state: dict[str, Any] = {
            "state_dict": get_model_state_dict(self.model, options=TRAINED_ONLY),
            "optimizer_states": {
                str(i): get_optimizer_state_dict(self.model, opt, options=TRAINED_ONLY)
                for i, opt in enumerate(optimizers)
            },
        }
        dcp.load(state, checkpoint_id=path)
        # strict=False: the frozen bases are absent on purpose; every trained key is in `state`
        # (dcp.load fails on any of them the checkpoint lacks)
        set_model_state_dict(
            self.model,
            state["state_dict"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(
                self.model, opt, state["optimizer_states"][str(i)], options=TRAINED_ONLY
            )
        self._regather()  # from the loaded shards
        return torch.load(path / META_FILE, map_location="cpu", weights_only=False)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded by `load_checkpoint`

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded by `load_checkpoint`
