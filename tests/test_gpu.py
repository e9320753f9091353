"""vLLM path (needs a CUDA GPU and the gpu extra; skipped elsewhere, run by scripts/gpu_smoke.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_vllm_generates_and_takes_new_weights(tiny_models_dir: Path) -> None:
    pytest.importorskip("vllm")
    from mars2.generation.vllm_backend import VLLMGenerator
    from mars2.models.loading import ModelSpec, load_policy, load_tokenizer
    from mars2.training.agent_module import GenerationConfig

    path = str(tiny_models_dir / "tiny_qwen3")
    tokenizer = load_tokenizer(path)
    config = GenerationConfig(
        backend="vllm", max_new_tokens=16, vllm={"gpu_memory_utilization": 0.2}
    )
    generator = VLLMGenerator(ModelSpec(path=path), tokenizer, config)
    chats = [[{"role": "user", "content": "print a number"}]] * 4
    first = generator.generate(chats)
    assert len(first) == 4 and all(c.token_ids and c.logprobs is not None for c in first)
    assert all(len(c.logprobs or []) == len(c.token_ids) for c in first)
    policy = load_policy(ModelSpec(path=path))
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(0.0)  # a degenerate model: every logit equal, so sampling becomes uniform
    generator.sync_weights(policy)
    after = generator.generate(chats)
    uniform = -torch.log(torch.tensor(float(policy.config.vocab_size)))
    assert all(abs(lp - float(uniform)) < 1e-2 for c in after for lp in (c.logprobs or []))


def test_lora_agents_on_one_base_share_an_engine(tiny_models_dir: Path) -> None:
    pytest.importorskip("vllm")
    from mars2.generation.vllm_backend import SharedBaseLoRAGenerator
    from mars2.models.loading import LoraSpec, ModelSpec, load_policy, load_tokenizer
    from mars2.training.agent_module import GenerationConfig

    spec = ModelSpec(
        path=str(tiny_models_dir / "tiny_qwen3"),
        lora=LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    )
    tokenizer = load_tokenizer(spec.path)
    config = GenerationConfig(
        backend="vllm", max_new_tokens=8, vllm={"shared_base": True, "gpu_memory_utilization": 0.2}
    )
    generators = []
    for name in ("a", "b"):
        generator = SharedBaseLoRAGenerator(spec, tokenizer, config, f"/tmp/mars2-gpu-test-{name}")
        generator.sync_weights(load_policy(spec))
        generators.append(generator)
    assert generators[0].llm is generators[1].llm
    outputs = [g.generate([[{"role": "user", "content": "hi"}]])[0] for g in generators]
    assert all(o.token_ids for o in outputs)
