"""One length per agent for the memory check and the vLLM engine (issue #43, point 2).

No vLLM here: the engine's side is the `vllm.LLM` arguments `engine_args` builds.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from mars2.generation.config import GenerationConfig
from mars2.generation.vllm_backend import engine_args
from mars2.models.loading import ModelSpec
from mars2.training.memory import compose, estimate_config

SPEC = ModelSpec("some/model", dtype="bfloat16")


def test_engine_gets_prompt_plus_completion_cap_explicitly() -> None:
    capped = GenerationConfig(backend="vllm", max_prompt_tokens=2048, max_new_tokens=16384)
    assert capped.max_model_len == 18432
    assert engine_args(SPEC, capped)["max_model_len"] == 18432  # not the model's 40,960
    given = GenerationConfig(backend="vllm", max_prompt_tokens=8, max_new_tokens=8,
                             vllm={"max_model_len": 32})  # fmt: skip
    assert engine_args(SPEC, given)["max_model_len"] == 32
    short = GenerationConfig(backend="vllm", max_prompt_tokens=2048, max_new_tokens=16384,
                             vllm={"max_model_len": 4096})  # fmt: skip
    with pytest.raises(ValueError, match=r"shorter than generation\.max_prompt_tokens"):
        engine_args(SPEC, short)
    assert "max_model_len" not in engine_args(SPEC, GenerationConfig(backend="vllm"))


@pytest.mark.parametrize("agent", ["qwen3_32b", "nemotron_32b"])
def test_32b_configs_set_the_lengths_the_memory_check_assumes(agent: str) -> None:
    cfg = compose(["experiment=qwen3_32b_pair", "memory.gpu=h200"])
    generation = OmegaConf.to_container(cfg.agents[agent].generation, resolve=True)
    assert isinstance(generation, dict)
    generation.pop("_target_")
    config = GenerationConfig(**generation)
    assert config.max_prompt_tokens == 2048 and config.max_new_tokens == 16384
    length = engine_args(SPEC, config, world_size=8)["max_model_len"]  # one 8-GPU node
    est = estimate_config(cfg)
    engine_lines = [line for line in est.engines if line.startswith(f"{agent}:")]
    assert len(engine_lines) == 1 and f"max_model_len={length} " in engine_lines[0]
    assert f"max_model_len={length}" in est.report()


def test_dry_run_prints_kv_cache_tokens_and_concurrency() -> None:
    est = estimate_config(compose(["experiment=qwen3_32b_pair", "memory.gpu=h200"]))
    line = next(e for e in est.engines if e.startswith("qwen3_32b:"))
    tokens = int(line.split("KV cache for ")[1].split(" ")[0])
    # 0.2 x 139.8 GiB, less 15.3 GiB of bf16 weights (tensor parallel over 4) and 2 GiB of work
    # space, at 64 KiB per token (2 x 64 layers x 2 of 8 KV heads x 128 x 2 bytes): about 175k
    # tokens, 9 sequences of 18,432 at once
    assert 170_000 < tokens < 180_000
    assert f"= {tokens // 18432} sequences of max_model_len=18432" in line
