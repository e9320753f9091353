"""The memory plan's sharding assumption, verified at start-up on two gloo CPU ranks.

`shard_agent` must accept a properly sharded LoRA agent (frozen base and adapters) and a fully
fine-tuned agent with its KL reference, and must refuse, before any step, an agent whose LoRA base
was left unsharded (numerically invisible: tests/test_sharding.py passes with it, but on 32B each
GPU would hold 61 GiB of base instead of 7.6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ranks import on_two_gloo_ranks

pytestmark = pytest.mark.slow


def _agent(tiny: str, lora: bool, beta: float) -> object:
    from mars2.models.loading import LoraSpec, ModelSpec
    from mars2.training.agent_module import AgentModule, GenerationConfig, OptimConfig
    from mars2.training.losses import LossConfig

    torch.manual_seed(0)
    return AgentModule(
        "tiny_qwen3",
        ModelSpec(
            path=str(Path(tiny) / "tiny_qwen3"), lora=LoraSpec(r=4, alpha=8) if lora else None
        ),
        GenerationConfig(),
        OptimConfig(),
        LossConfig(beta=beta),
    )


def _rank(rank: int, tiny: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from mars2.training import sharding

    mesh = init_device_mesh("cpu", (2,))
    results: list[str] = []
    sharding.shard_agent(_agent(tiny, lora=True, beta=0.0), mesh, 2)  # must not raise
    sharding.shard_agent(_agent(tiny, lora=False, beta=0.1), mesh, 2)  # policy + reference
    results.append("ok")
    real = sharding.shard_model

    def skip_peft(model: torch.nn.Module, mesh: object, **kw: object) -> None:
        if not hasattr(model, "peft_config"):  # the mutation: LoRA bases stay whole
            real(model, mesh, **kw)

    sharding.shard_model = skip_peft  # type: ignore[assignment]
    try:
        sharding.shard_agent(_agent(tiny, lora=True, beta=0.0), mesh, 2)
        results.append("accepted an unsharded LoRA base")
    except RuntimeError as e:
        results.append(str(e))
    finally:
        sharding.shard_model = real
    Path(out, f"rank{rank}.txt").write_text("\n".join(results))


def test_unsharded_lora_base_is_refused_before_the_first_step(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    on_two_gloo_ranks(_rank, str(tiny_models_dir), str(tmp_path))
    for rank in (0, 1):
        ok, refusal = Path(tmp_path, f"rank{rank}.txt").read_text().split("\n", 1)
        assert ok == "ok"
        assert "not sharded DTensors" in refusal, refusal
        assert "base_layer.weight" in refusal and "plan" in refusal


def test_sharding_problems_measure_local_bytes_against_the_plan() -> None:
    from mars2.training.sharding import sharding_problems

    whole = torch.nn.Linear(64, 64)
    problems = sharding_problems(whole, 4, "toy")
    assert any("not sharded DTensors" in p for p in problems)
    assert any("the plan" in p for p in problems)  # 4x the planned local bytes
    assert sharding_problems(whole, 1, "toy") == [
        "toy: 2 parameter(s) are not sharded DTensors: weight, bias"
    ]
