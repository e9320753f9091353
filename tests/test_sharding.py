"""Sharded training (FSDP2 per agent: full fine-tuning and LoRA) on two CPU processes over gloo.

The sharded team step must equal the unsharded step on the union of both ranks' samples, with
uneven micro-batch counts and an agent that has samples on one rank only, for fully fine-tuned and
LoRA agents alike; and a trainer=fsdp run (one agent of each kind) must checkpoint sharded (a LoRA
agent's adapters only) and resume to the same weights as an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mars2.generation.base import Completion
from mars2.models.loading import LoraSpec, ModelSpec
from mars2.rewards.routing import Sample
from mars2.search.tree import Node
from mars2.training.agent_module import AgentModule, GenerationConfig, OptimConfig, optimise_agent
from mars2.training.batching import micro_batches
from mars2.training.losses import LossConfig
from tests.ranks import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
NAMES = ("tiny_qwen3", "tiny_llama")
# Which rank holds which samples: tiny_qwen3 has 3 on rank 0 (two micro-batches) and 1 on rank 1;
# tiny_llama has none on rank 0 (it runs an idle micro-batch there) and 2 on rank 1.
LAYOUT = {"tiny_qwen3": (3, 1), "tiny_llama": (0, 2)}
LR = 0.5


def make_agent(tiny: Path, name: str, lora: bool = False) -> AgentModule:
    torch.manual_seed(0)
    agent = AgentModule(
        name,
        ModelSpec(path=str(tiny / name), lora=LoraSpec(r=4, alpha=8) if lora else None),
        GenerationConfig(),
        OptimConfig(grad_clip=1.0),
        LossConfig(beta=0.05 if name == "tiny_qwen3" else 0.0),  # one agent with a KL reference
        micro_batch_size=2,
    )
    if lora:  # non-zero adapters: the KL term and both A and B get gradients
        with torch.no_grad():
            for key, p in agent.policy.named_parameters():
                if "lora_B" in key:
                    p.copy_(torch.randn_like(p) * 0.1)
    return agent


CASES = [(name, lora) for lora in (False, True) for name in NAMES]


def make_samples(agent: AgentModule, count: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    vocab = min(agent.tokenizer.vocab_size, 200)
    samples = []
    for i in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        completion = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]
        node = Node(
            i + 1,
            0,
            1,
            agent=agent.name,
            completion=Completion(text="", prompt_token_ids=prompt, token_ids=completion),
        )
        samples.append(Sample(node, 0, 0.0, rng.uniform(-1, 1)))  # fmt: skip
    return samples


def all_samples(agent: AgentModule) -> tuple[list[Sample], list[Sample]]:
    first, second = LAYOUT[agent.name]
    pool = make_samples(agent, first + second, seed=len(agent.name))
    return pool[:first], pool[first:]


def step(agent: AgentModule, samples: list[Sample], total: int) -> dict[str, float]:
    """The team's per-agent step: the route of the active strategy, then optimise_agent."""
    from mars2.training.distributed import agent_step_route, global_counts

    optimizer = torch.optim.SGD([p for p in agent.policy.parameters() if p.requires_grad], lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    batches = micro_batches(samples, agent.micro_batch_size, agent.tokenizer.pad_token_id)
    backward, sync, pad = agent_step_route(agent, lambda loss: loss.backward())
    return optimise_agent(
        agent, optimizer, scheduler, batches, backward, len(samples), sync_gradients=sync,
        global_sizes=lambda sizes: global_counts(sizes, torch.device("cpu")), pad=pad,
    )  # fmt: skip


def _worker(rank: int, port: int, tiny: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from mars2.training.sharding import full_state_dict, is_sharded, shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    results: dict[Any, Any] = {}
    for name, lora in CASES:
        agent = make_agent(Path(tiny), name, lora)
        shard_model(agent.policy, mesh)
        for reference in agent._reference:
            shard_model(reference, mesh)
        assert is_sharded(agent.policy)
        local = all_samples(agent)[rank]
        metrics = step(agent, local, sum(LAYOUT[name]))
        # Each rank's loss is its share of the step's (normalised by the global sizes): they sum.
        loss = torch.tensor([metrics["loss"]])
        dist.all_reduce(loss)
        weights = {k: v.detach().clone() for k, v in full_state_dict(agent.policy)}
        results[name, lora] = {
            "loss": float(loss),
            "grad_norm": metrics["grad_norm"],
            "weights": weights,
        }
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_team_step_equals_the_unsharded_step(tmp_path: Path, tiny_models_dir: Path) -> None:
    out = tmp_path / "sharded.pt"
    mp.spawn(_worker, args=(free_port(), str(tiny_models_dir), str(out)), nprocs=2)
    sharded = torch.load(out, weights_only=False)
    for name, lora in CASES:
        agent = make_agent(tiny_models_dir, name, lora)
        before = {k: v.clone() for k, v in agent.policy.state_dict().items()}
        first, second = all_samples(agent)
        metrics = step(agent, first + second, len(first) + len(second))
        got = sharded[name, lora]
        assert got["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)  # summation order
        moved = 0
        for key, value in agent.policy.state_dict().items():
            torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6)
            moved += int(not torch.equal(before[key], value))
        assert moved > 0, f"{name}: the step changed nothing"
        if lora:  # the frozen base stayed as it was, sharded or not
            assert all(
                torch.equal(before[k], got["weights"][k]) for k in before if "lora_" not in k
            )


def _train(tmp: Path, tiny: Path, *overrides: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MARS2_TINY_MODELS": str(tiny)}
    command = [
        sys.executable, str(REPO / "tests/fsdp_run.py"), "experiment=tiny_pair", "debug=fast",
        "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
        "logger=csv", "sandbox.num_workers=1", "problems_per_step=1", "~callbacks.progress",
        "+trainer.enable_progress_bar=false", f"paths.output_dir={tmp}", f"paths.log_dir={tmp}/logs",
        f"paths.tiny_models_dir={tiny}", *overrides,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
    assert result.returncode == 0, result.stderr[-4000:]


# tiny_llama trains a LoRA adapter on its sharded frozen base, tiny_qwen3 is fully fine-tuned
LORA = "+agents.tiny_llama.model.lora={_target_:mars2.models.loading.LoraSpec,r:4,alpha:8}"
SAVED = {"tiny_qwen3": "model.safetensors", "tiny_llama": "adapter_model.safetensors"}


def _final_weights(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {name: load_file(run / "agents" / name / SAVED[name]) for name in NAMES}


def test_fsdp_run_checkpoints_sharded_and_resumes(tmp_path: Path, tiny_models_dir: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    _train(whole, tiny_models_dir, "steps=2", LORA)
    checkpoint = whole / "checkpoints" / "step_000001.ckpt"
    assert checkpoint.is_dir() and (checkpoint / "meta.pt").is_file()
    assert len(list(checkpoint.glob("*.distcp"))) == 2  # one shard file per rank
    saved = [k for k in FileSystemReader(checkpoint).read_metadata().state_dict_metadata
             if k.startswith("state_dict.agents.tiny_llama.")]  # fmt: skip
    assert saved and all("lora_" in k for k in saved)  # the adapters, not the frozen base
    _train(resumed, tiny_models_dir, "steps=2", f"ckpt_path={checkpoint}", LORA)
    assert not (resumed / "trees" / "step_000001_rank0.jsonl").exists()  # step 1 was not redone
    first, second = _final_weights(whole), _final_weights(resumed)
    initial = load_file(tiny_models_dir / "tiny_qwen3" / "model.safetensors")
    assert any(not torch.equal(initial[k], first["tiny_qwen3"][k]) for k in initial)  # it trained
    assert any(v.abs().sum() > 0 for k, v in first["tiny_llama"].items() if "lora_B" in k)
    for name in NAMES:
        for key, value in first[name].items():
            assert value.shape == second[name][key].shape  # whole tensors, not one rank's shard
            torch.testing.assert_close(second[name][key], value, rtol=1e-5, atol=1e-6)


def test_fsdp_refuses_agents_it_cannot_shard(tiny_models_dir: Path) -> None:
    from dataclasses import replace

    from mars2.training.sharding import check_shardable

    agent = make_agent(tiny_models_dir, "tiny_llama")
    check_shardable(agent)  # full fine-tuning with AdamW is what it shards
    agent.model_spec = replace(agent.model_spec, lora=LoraSpec(r=8))
    check_shardable(agent)  # and LoRA on a 16/32-bit base
    # QLoRA: checked on the spec alone (bitsandbytes needs a GPU to load one)
    agent.model_spec = replace(agent.model_spec, quantization="4bit")
    with pytest.raises(ValueError, match=r"cannot shard a bitsandbytes 4bit base.*trainer=ddp"):
        check_shardable(agent)
    agent.model_spec = replace(agent.model_spec, quantization=None)
    agent.optim_config = replace(agent.optim_config, optimizer="adamw8bit")
    with pytest.raises(ValueError, match="AdamW8bit cannot step sharded"):
        check_shardable(agent)
