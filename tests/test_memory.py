"""The per-GPU memory estimate: hand-computed cases, the start-up refusal, the shipped experiments."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from omegaconf import open_dict

from mars2.models.memory import (
    GIB,
    AgentPlan,
    ClusterPlan,
    EnginePlan,
    MemoryBudgetError,
    ModelShape,
    check,
    estimate,
)
from mars2.training.memory import check_memory, compose, estimate_config, model_shape

# Qwen3-14B's published config.json values.
QWEN3_14B = {
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "intermediate_size": 17408,
    "vocab_size": 151936,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
}
# By hand: embeddings 2 x 151936 x 5120 = 1_555_824_640; per layer q,o 2 x 5120^2 = 52_428_800,
# k,v 2 x 5120 x 1024 = 10_485_760, MLP 3 x 5120 x 17408 = 267_386_880, so 330_301_440 x 40 layers
# = 13_212_057_600; RMSNorms (2 x 40 + 1) x 5120 = 414_720.
QWEN3_14B_PARAMS = 1_555_824_640 + 13_212_057_600 + 414_720


def test_parameter_count_of_qwen3_14b_matches_the_hand_count() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)
    assert shape.total_params == QWEN3_14B_PARAMS
    assert abs(shape.total_params - 14.8e9) / 14.8e9 < 0.01  # the model card's 14.8B


def test_full_fine_tuning_terms_match_a_hand_computation() -> None:
    # One agent, bf16, AdamW, reference, no checkpointing, one GPU: every term by hand.
    shape = ModelShape(
        hidden_size=8, num_layers=2, intermediate_size=16, vocab_size=10,
        num_attention_heads=2, num_kv_heads=1, head_dim=4,
    )  # fmt: skip
    # q 8x8 + k 8x4 + v 8x4 + o 8x8 + 3 x 8x16 = 576 per layer; embeddings 2 x 80; norms 5 x 8
    params = 2 * 576 + 160 + 40
    assert shape.total_params == params
    plan = AgentPlan(
        name="a", shape=shape, dtype="bfloat16", reference=True,
        gradient_checkpointing=False, micro_batch_size=2, seq_len=5, logprob_chunk_tokens=0,
    )  # fmt: skip
    est = estimate([plan], ClusterPlan(gpu_gib=80.0))
    by_name = {t.name: t.gib * GIB for t in est.terms}
    assert by_name["weights (bfloat16)"] == params * 2
    assert by_name["gradients"] == params * 2
    assert by_name["optimizer states (adamw)"] == params * 2 * 2  # exp_avg + exp_avg_sq in bf16
    assert by_name["reference (bfloat16)"] == params * 2
    # 10 tokens; per layer (8 x 8 + 4 x 16) elements per token in bf16, 2 layers
    assert by_name["activations (10 tokens)"] == 2 * 10 * (64 + 64) * 2
    assert by_name["logits and log-probs"] == 10 * 10 * 18
    resident = 2.0 * GIB + params * (2 + 2 + 4 + 2)
    assert est.train_peak * GIB == pytest.approx(resident + 2 * 10 * 128 * 2 + 1800)


def test_sharding_divides_trainable_state_by_the_world_size() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)
    plan = AgentPlan(name="a", shape=shape, reference=True)
    alone = {t.name: t.gib for t in estimate([plan], ClusterPlan(140.0, 8)).terms}
    sharded = {t.name: t.gib for t in estimate([plan], ClusterPlan(140.0, 8, sharded=True)).terms}
    for name in ("weights (bfloat16)", "gradients", "optimizer states (adamw)"):
        assert sharded[name] == pytest.approx(alone[name] / 8)
    assert alone["weights (bfloat16)"] * GIB == QWEN3_14B_PARAMS * 2


def test_lora_and_qlora_shrink_the_base_and_train_only_the_adapter() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)
    lora = AgentPlan(name="a", shape=shape, lora_r=64)
    qlora = AgentPlan(name="a", shape=shape, lora_r=64, quantization="4bit")
    terms = {t.name: t.gib * GIB for t in estimate([lora], ClusterPlan(140.0)).terms}
    # adapters: r x (in + out) per projection, 40 layers
    adapter = 64 * (10240 + 6144 + 6144 + 10240 + 3 * 22528) * 40
    assert terms["LoRA r=64 weights (fp32)"] == adapter * 4
    assert terms["optimizer states (adamw)"] == adapter * 8
    assert terms["frozen base (bfloat16)"] == QWEN3_14B_PARAMS * 2
    q = {t.name: t.gib * GIB for t in estimate([qlora], ClusterPlan(140.0)).terms}
    linear = 13_212_057_600
    assert q["frozen base (4bit)"] == pytest.approx(
        linear * (0.5 + 0.127 / 8) + (QWEN3_14B_PARAMS - linear) * 2
    )


def test_the_check_refuses_only_an_estimate_over_the_usable_memory() -> None:
    # No engine: the peak does not depend on the GPU's size, so the GPU can be sized around it.
    plan = AgentPlan(name="a", shape=ModelShape.from_mapping(QWEN3_14B), lora_r=64)
    peak = estimate([plan], ClusterPlan(1000.0)).peak
    at_the_limit = estimate([plan], ClusterPlan(peak / 0.92 * (1 + 1e-9)))
    assert at_the_limit.peak == pytest.approx(peak) and at_the_limit.fits
    check(at_the_limit)  # usable == peak (to 1e-9): runs
    just_over = estimate([plan], ClusterPlan(peak / 0.92 * (1 - 1e-6)))
    assert not just_over.fits and not just_over.problems
    with pytest.raises(MemoryBudgetError, match=r"needs about .* GiB per GPU"):
        check(just_over)


def test_an_engine_too_small_for_its_weights_is_refused() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)
    engine = EnginePlan(gpu_memory_utilization=0.1, sleep=True, max_model_len=4096, key="a")
    plan = AgentPlan(name="a", shape=shape, lora_r=16, engine=engine)
    est = estimate([plan], ClusterPlan(139.8))
    assert not est.fits
    with pytest.raises(MemoryBudgetError, match=r"gpu_memory_utilization to at least 0\.22 "):
        check(est)


def test_the_old_full_fine_tuned_headline_run_is_refused_at_start_up() -> None:
    cfg = compose(["experiment=areal14b_pair", "trainer=ddp", "memory.gpu=h200"])
    with open_dict(cfg):
        for agent in cfg.agents.values():
            agent.model.lora = None  # what areal14b_pair was before: full fine-tuning under DDP
    with pytest.raises(MemoryBudgetError) as refused:
        check_memory(cfg)
    message = str(refused.value)
    assert "GiB per GPU" in message and "139.8 GiB GPU" in message
    assert "optimizer states (adamw)" in message
    assert "trainer=fsdp" in message and "LoRA" in message  # the knobs that fix it


@pytest.mark.parametrize(
    ("overrides", "fits"),
    [
        (["experiment=areal14b_pair", "trainer=ddp", "memory.gpu=h200"], True),
        (["experiment=areal14b_pair", "trainer=ddp", "memory.gpu=h100"], False),
        (["experiment=areal14b_pair_qlora", "trainer=ddp", "memory.gpu=h100"], True),
        (["experiment=areal14b_pair_full", "trainer=fsdp", "memory.gpu=h200"], True),
        (["experiment=areal14b_pair_full", "trainer=ddp", "memory.gpu=h200"], False),
    ],
)
def test_shipped_headline_experiments(overrides: list[str], fits: bool) -> None:
    assert estimate_config(compose(overrides)).fits is fits


def test_cpu_runs_are_not_checked() -> None:
    assert check_memory(compose(["experiment=tiny_pair"])) is None


def test_sizes_come_from_a_local_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    assert model_shape("a", {"path": str(tmp_path)}).total_params == QWEN3_14B_PARAMS
    with pytest.raises(ValueError, match=r"declare model\.architecture"):
        model_shape("a", {"path": str(tmp_path / "missing")})


def test_an_agent_of_unknown_size_is_not_blocked_at_start_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = compose(["experiment=areal14b_pair", "~agents.qwen3_14b.model.architecture"])
    with pytest.raises(ValueError, match=r"qwen3_14b: cannot size 'Qwen/Qwen3-14B'"):
        estimate_config(cfg)  # the dry run says why
    assert check_memory(cfg) is None  # the run itself only warns
    assert "memory estimate skipped" in caplog.text


def test_chunked_logits_count_one_chunk_of_the_vocabulary() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)
    whole = AgentPlan(name="a", shape=shape, lora_r=16, seq_len=18432, logprob_chunk_tokens=0)
    chunked = dataclasses.replace(whole, logprob_chunk_tokens=1024)
    full_ft = dataclasses.replace(chunked, lora_r=None)

    def logits(plan: AgentPlan) -> float:
        terms = {t.name: t.gib * GIB for t in estimate([plan], ClusterPlan(139.8)).terms}
        return terms["logits and log-probs"]

    assert logits(whole) == 18432 * 151936 * 18  # 47 GiB: the 16k-token sample
    # one [1024, vocab] chunk at 8 bytes, plus the bf16 hidden states the chunks read
    assert logits(chunked) == 1024 * 151936 * 8 + 18432 * 5120 * 2
    # a trained output head adds its fp32 gradient accumulator
    assert logits(full_ft) == logits(chunked) + 151936 * 5120 * 4
    assert logits(whole) / logits(chunked) > 25


def test_fsdp_shards_a_lora_agents_frozen_base_but_not_a_quantised_one() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)
    lora = AgentPlan(name="a", shape=shape, lora_r=64)
    qlora = dataclasses.replace(lora, quantization="4bit")
    sharded, alone = ClusterPlan(139.8, 8, sharded=True), ClusterPlan(139.8, 8)
    for plan, divided in ((lora, True), (qlora, False)):
        a = {t.name: t.gib for t in estimate([plan], alone).terms}
        b = {t.name: t.gib for t in estimate([plan], sharded).terms}
        base = f"frozen base ({plan.quantization or plan.dtype})"
        assert b[base] == pytest.approx(a[base] / 8 if divided else a[base])
        assert b["optimizer states (adamw)"] == pytest.approx(
            a["optimizer states (adamw)"] / (8 if divided else 1)
        )
        assert ("all-gathered layers (FSDP)" in b) is divided


def test_tensor_parallel_engines_split_weights_and_kv_heads() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)  # 8 KV heads
    need = {}
    for tp in (1, 4, 16):
        engine = EnginePlan(0.01, sleep=False, max_model_len=4096, key="a", tensor_parallel_size=tp)
        (problem,) = estimate([AgentPlan(name="a", shape=shape, engine=engine)],
                              ClusterPlan(139.8, 16)).problems  # fmt: skip
        need[tp] = float(problem.split(" need ")[1].split(" GiB")[0])
    weights = QWEN3_14B_PARAMS * 2 / GIB
    kv = 2 * 40 * 8 * 128 * 2 * 4096 / GIB
    assert need[1] == pytest.approx(weights + kv + 2.0, abs=0.05)
    assert need[4] == pytest.approx(weights / 4 + kv / 4 + 2.0, abs=0.05)
    # beyond 8 ranks a KV head is replicated, not split further
    assert need[16] == pytest.approx(weights / 16 + kv / 8 + 2.0, abs=0.05)


def test_a_sync_streams_one_layer_not_the_whole_weights() -> None:
    shape = ModelShape.from_mapping(QWEN3_14B)
    engine = EnginePlan(gpu_memory_utilization=0.25, sleep=True, max_model_len=4096, key="a")
    plan = AgentPlan(name="a", shape=shape, engine=engine)
    est = estimate([plan], ClusterPlan(139.8, 8, sharded=True))
    terms = {t.name: t for t in est.terms}
    sync = terms["one layer during a streamed sync"]
    # the largest piece held whole: the 151936 x 5120 embedding (a decoder layer is 330M)
    assert sync.phase == "generate" and sync.gib * GIB == 151936 * 5120 * 2
    resident = est.phase("resident")
    assert est.generate_peak == pytest.approx(resident + 0.25 * 139.8 + sync.gib)
    # shared-base LoRA engines load the adapter from disk: nothing streamed
    shared = EnginePlan(0.25, sleep=False, max_model_len=4096, key="Qwen/Qwen3-14B")
    lora = AgentPlan(name="a", shape=shape, lora_r=16, engine=shared)
    names = {t.name for t in estimate([lora], ClusterPlan(139.8, 8)).terms}
    assert "one layer during a streamed sync" not in names


def test_the_32b_pair_fits_one_h200_node_and_full_fine_tuning_two() -> None:
    lora = estimate_config(compose(["experiment=qwen3_32b_pair", "memory.gpu=h200"]))
    assert lora.fits and lora.cluster.world_size == 8 and lora.cluster.sharded
    terms = {(t.agent, t.name): t.gib for t in lora.terms}
    assert terms[("qwen3_32b", "frozen base (bfloat16)")] == pytest.approx(61.0 / 8, abs=0.1)
    full = compose(["experiment=qwen3_32b_pair_full", "memory.gpu=h200"])
    assert estimate_config(full).fits and estimate_config(full).cluster.world_size == 16
    one_node = compose(["experiment=qwen3_32b_pair_full", "memory.gpu=h200", "trainer.num_nodes=1"])
    assert not estimate_config(one_node).fits


def test_memory_knobs_follow_swapped_agents() -> None:
    cfg = compose(["experiment=qwen3_8b_areal8b_pair", "agent=[qwen3_8b,qwen3_14b]"])
    assert list(cfg.agents) == ["qwen3_8b", "qwen3_14b"]  # no stray half-configured agent
    assert all(a.generation.vllm.enable_sleep_mode for a in cfg.agents.values())
    lora = compose(["experiment=areal14b_pair", "scale.lora.r=16"])
    assert {a.model.lora.r for a in lora.agents.values()} == {16}


def test_train_cli_refuses_before_loading_a_model(tmp_path: Path) -> None:
    # Offline, with hub ids for models: had a model been loaded first, this would be a load error.
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(repo / "src/mars2/train.py"), "experiment=areal14b_pair",
         "trainer=ddp", "memory.gpu=h100", "logger=none", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.startswith("Error: the run needs") and "Traceback" not in result.stderr
    assert "usable (79.2 GiB GPU)" in result.stderr


def test_memory_tool_names_the_nearest_experiment(capsys) -> None:
    from mars2.training.memory import main

    assert main(["experiment=tiny_pairr"]) == 1
    err = capsys.readouterr().err
    assert "did you mean experiment=tiny_pair?" in err and "Could not find" not in err
