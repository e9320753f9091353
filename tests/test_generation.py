"""Generators: log-probs that match the trainer's, scripted answers, LoRA weight merging for vLLM,
the generator factory and engine pool (vLLM replaced by a fake engine: it cannot run here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import StaleWeightsError, build_generators
from mars2.generation.prompt import encode_prompt
from mars2.generation.transformers_backend import ScriptedGenerator, TransformersGenerator
from mars2.generation.vllm_backend import engine_args, lora_rank, merged_weights, streamed_weights
from mars2.models.loading import LoraSpec, ModelSpec, load_policy, load_tokenizer
from mars2.training.agent_module import AgentModule
from mars2.training.losses import token_logprobs
from tests.fakes.vllm_engine import FakeRuntime

REPO = Path(__file__).resolve().parents[1]

CHAT = [{"role": "user", "content": "Write a program."}]


def test_rollout_logprobs_equal_the_trainers(tiny_models_dir: Path) -> None:
    path = str(tiny_models_dir / "tiny_llama")
    model, tokenizer = load_policy(ModelSpec(path)), load_tokenizer(path)
    generator = TransformersGenerator(model, tokenizer, max_new_tokens=12, temperature=0.7)
    for completion in generator.generate([CHAT, CHAT[:1] * 1]):
        ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
        start = len(completion.prompt_token_ids) - 1
        with torch.no_grad():
            logits = model(ids).logits[:, start:-1]
        recomputed = token_logprobs(logits, ids[:, start + 1 :], temperature=0.7)[0]
        assert completion.logprobs is not None and len(completion.logprobs) == len(
            completion.token_ids
        )
        torch.testing.assert_close(
            recomputed, torch.tensor(completion.logprobs), atol=1e-4, rtol=1e-4
        )
    assert all(not c.truncated or len(c.token_ids) == 12 for c in generator.generate([CHAT] * 3))


def test_scripted_generator_tokenizes_with_the_agents_tokenizer(tiny_models_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_models_dir / "tiny_qwen3"))
    (completion,) = ScriptedGenerator(tokenizer, lambda chat: "print(1)").generate([CHAT])
    assert completion.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(completion.token_ids[:-1]) == "print(1)"


def test_lora_weights_merge_without_destroying_the_adapter(tiny_models_dir: Path) -> None:
    spec = ModelSpec(
        str(tiny_models_dir / "tiny_qwen3"),
        lora=LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    )
    policy = load_policy(spec)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)  # a non-zero adapter
    base = load_policy(ModelSpec(spec.path))
    weights = dict(merged_weights(policy))
    assert set(weights) == set(base.state_dict())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[q], base.state_dict()[q])  # the adapter is merged in
    assert any("lora_A" in n for n, _ in policy.named_parameters())  # and still there
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        with_adapter = policy(ids).logits
        with policy.disable_adapter():
            without = policy(ids).logits
    assert not torch.allclose(with_adapter, without)


def test_streamed_weights_merge_lora_like_peft_and_leave_the_policy_untouched(
    tiny_models_dir: Path,
) -> None:
    import copy

    spec = ModelSpec(
        str(tiny_models_dir / "tiny_llama"),
        lora=LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj")),
    )
    policy = load_policy(spec)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()  # peft's own merge
    stream = streamed_weights(policy)
    assert not isinstance(stream, list | dict)  # produced one tensor at a time
    got = dict(stream)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6)
    # the policy's own tensors are exactly as they were (peft's merge/unmerge rounds them)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


# -- the generator factory, engine pool and vLLM generators (a fake engine: no vLLM here) --------


def _agent(path: Path, config: GenerationConfig, lora: LoraSpec | None = None) -> AgentModule:
    return AgentModule(path.name, ModelSpec(str(path), lora=lora), config)


def _perturb(policy: Any, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def test_lora_rank_rounds_up_to_a_rank_vllm_accepts() -> None:
    assert [lora_rank(r) for r in (1, 2, 4, 8, 9, 300, 321, 512)] == [
        1, 8, 8, 8, 16, 320, 512, 512,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="above the largest rank"):
        lora_rank(513)


def test_engine_args_follow_vllms_rl_recipe() -> None:
    spec = ModelSpec("some/model", dtype="bfloat16")
    config = GenerationConfig(backend="vllm", vllm={"enable_sleep_mode": True, "max_model_len": 64})
    args = engine_args(spec, config, world_size=2)
    assert args["logprobs_mode"] == "processed_logprobs"  # after temperature, as the trainer's
    assert args["distributed_executor_backend"] == "external_launcher"  # one engine per DDP rank
    assert args["enable_sleep_mode"] is True and args["max_model_len"] == 64
    assert "sleep_level" not in args and "shared_base" not in args
    assert "distributed_executor_backend" not in engine_args(spec, config)
    lora = engine_args(spec, GenerationConfig(backend="vllm"), lora_slots=3, max_lora_r=4)
    assert (lora["enable_lora"], lora["max_loras"], lora["max_lora_rank"]) == (True, 3, 8)
    with pytest.raises(ValueError, match="processed_logprobs"):
        engine_args(spec, GenerationConfig(backend="vllm", vllm={"logprobs_mode": "raw_logprobs"}))


def test_tensor_parallel_engines_are_checked_before_they_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mars2.generation.engines import _launcher_ranks

    spec = ModelSpec("some/model")
    config = GenerationConfig(backend="vllm", vllm={"tensor_parallel_size": 2})
    args = engine_args(spec, config, world_size=4)
    assert args["tensor_parallel_size"] == 2  # vLLM's own argument, passed through
    assert args["distributed_executor_backend"] == "external_launcher"
    with pytest.raises(ValueError, match="needs 2 trainer ranks"):
        engine_args(spec, config)  # one process cannot be two tensor-parallel workers
    pool = EnginePool(FakeRuntime())
    assert pool.engine_group(1) is None  # no group without tensor parallelism
    with pytest.raises(ValueError, match="share one tensor_parallel_size"):
        pool.engine_group(2)
    with pytest.raises(ValueError, match="must divide the number of trainer ranks"):
        EnginePool(FakeRuntime()).engine_group(2)  # one process here, not a group of two
    from types import SimpleNamespace

    from mars2.generation.vllm_backend import VLLMGenerator

    sleepy = GenerationConfig(backend="vllm", vllm={"enable_sleep_mode": True})
    with pytest.raises(ValueError, match="tensor-parallel engine stays awake"):
        VLLMGenerator(None, FakeRuntime(), None, sleepy, SimpleNamespace(size=2), "agent:a")  # type: ignore[arg-type]
    # vLLM's external_launcher reads RANK/LOCAL_RANK: a launcher's own values are kept
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _launcher_ranks() == {}
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert _launcher_ranks()["LOCAL_RANK"] == "3"  # srun's; RANK comes from the process group


def test_a_stale_generator_raises_until_synced(tiny_models_dir: Path) -> None:
    agent = _agent(tiny_models_dir / "tiny_llama", GenerationConfig(max_new_tokens=4))
    generator = build_generators({agent.name: agent})[agent.name]
    agent.generator = generator
    assert len(generator.generate([CHAT])) == 1
    optimizer, _ = agent.build_optimizer()
    agent.policy(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()  # an optimizer step moves the agent's weights version
    with pytest.raises(StaleWeightsError, match="tiny_llama"):
        generator.generate([CHAT])
    assert generator.catch_up() and not generator.catch_up()
    assert len(generator.generate([CHAT])) == 1
    agent.load_state_dict(agent.state_dict())  # so does loading weights (resume, eval ckpt)
    assert generator.stale


def test_a_checkpoint_of_an_untrained_optimizer_leaves_the_generator_current(
    tiny_models_dir: Path,
) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    agent = _agent(tiny_models_dir / "tiny_llama", GenerationConfig(max_new_tokens=4))
    agent.generator = build_generators({agent.name: agent})[agent.name]
    optimizer, _ = agent.build_optimizer()
    before = {k: v.clone() for k, v in agent.policy.state_dict().items()}
    # trainer=fsdp's checkpoint: an optimizer without state is stepped at lr 0 to create it
    get_optimizer_state_dict(agent.policy, optimizer)
    assert optimizer.state and all(g["lr"] > 0 for g in optimizer.param_groups)  # it stepped
    assert all(torch.equal(v, before[k]) for k, v in agent.policy.state_dict().items())
    assert not agent.generator.stale  # the weights did not change: nothing to sync
    assert len(agent.generator.generate([CHAT])) == 1


def test_eval_of_a_checkpoint_with_vllm_samples_the_checkpoint(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    from hydra import compose, initialize_config_dir

    from mars2.eval.run import eval_generators, load_team
    from mars2.training.team_module import MultiAgentModule

    path = tiny_models_dir / "tiny_qwen3"
    trained = _agent(path, GenerationConfig(backend="vllm"))
    _perturb(trained.policy, 0)
    checkpoint = tmp_path / "trained.ckpt"
    torch.save({"state_dict": MultiAgentModule({trained.name: trained}).state_dict()}, checkpoint)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[
            "agent=[tiny_qwen3]", f"paths.tiny_models_dir={tiny_models_dir}",
            "agents.tiny_qwen3.generation.backend=vllm", f"ckpt_path={checkpoint}",
        ])  # fmt: skip
    team = load_team(cfg)
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        generators = eval_generators(team, 0.5, pool)
        (llm,) = runtime.started
        assert generators[trained.name].config.temperature == 0.5  # eval.temperature is used
        for name, value in llm.model.state_dict().items():
            torch.testing.assert_close(value, trained.policy.state_dict()[name])
        sampled = generators[trained.name].generate([CHAT])[0].token_ids
    prompt = encode_prompt(trained.tokenizer, CHAT)
    with torch.no_grad():
        expected = trained.policy.eval().generate(torch.tensor([prompt]), do_sample=False,
                                                  max_new_tokens=len(sampled))  # fmt: skip
    assert sampled == expected[0, len(prompt) :].tolist()
    assert runtime.closed == [llm]


def test_streaming_refuses_tensor_parallel_engines(tiny_models_dir: Path) -> None:
    # the pipelined driver streams per rank; a tensor-parallel group's ranks must replay one order
    config = GenerationConfig(backend="vllm", vllm={"tensor_parallel_size": 2})
    agent = _agent(tiny_models_dir / "tiny_llama", config)
    with EnginePool(FakeRuntime()) as pool, pytest.raises(ValueError, match="rounds driver"):
        build_generators({agent.name: agent}, pool, streaming=True)


def test_sleeping_engine_wakes_only_into_current_weights(tiny_models_dir: Path) -> None:
    config = GenerationConfig(backend="vllm", max_new_tokens=3, vllm={"enable_sleep_mode": True})
    agent = _agent(tiny_models_dir / "tiny_llama", config)
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        generator = build_generators({agent.name: agent}, pool)[agent.name]
        (llm,) = runtime.started
        assert llm.args["enable_sleep_mode"] is True
        generator.generate([CHAT])
        assert llm.calls[-1] == ("sleep", 2) and generator.backend.asleep
        with pytest.raises(RuntimeError, match="asleep"):
            generator.backend.generate([CHAT])  # its weights were discarded
        llm.calls.clear()
        agent.mark_weights_changed()
        generator.catch_up()
        assert llm.calls == [("wake_up", "weights"), ("reload_weights",),
                             ("wake_up", "kv_cache"), ("reset_prefix_cache",)]  # fmt: skip
        generator.generate([CHAT])
        llm.calls.clear()
        generator.generate([CHAT])  # asleep again, weights unchanged: they are pushed in again
        assert [c[0] for c in llm.calls[:3]] == ["wake_up", "reload_weights", "wake_up"]


def test_engine_pool_shares_one_base_between_lora_agents(tiny_models_dir: Path) -> None:
    lora = LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    config = GenerationConfig(backend="vllm", vllm={"shared_base": True})
    path = tiny_models_dir / "tiny_qwen3"
    agents = {n: AgentModule(n, ModelSpec(str(path), lora=lora), config) for n in ("a", "b")}
    runtime = FakeRuntime()
    pool = EnginePool(runtime)
    generators = build_generators(agents, pool)
    (llm,) = runtime.started
    assert (llm.args["max_loras"], llm.args["max_lora_rank"]) == (2, 8)
    first = generators["a"].backend._request
    assert Path(first.lora_path, "adapter_config.json").exists()
    assert first.lora_int_id != generators["b"].backend._request.lora_int_id
    agents["a"].mark_weights_changed()
    generators["a"].catch_up()
    assert ("remove", first.lora_int_id) in llm.calls and not Path(first.lora_path).exists()
    with pytest.raises(ValueError, match="must agree"):
        pool.engine(f"shared:{path}:float32", {**llm.args, "max_loras": 3})
    workdir = pool.workdir()
    pool.close()
    assert runtime.closed == [llm] and not workdir.exists() and len(pool) == 0


def test_vllm_agents_need_the_runs_pool(tiny_models_dir: Path) -> None:
    agent = _agent(tiny_models_dir / "tiny_llama", GenerationConfig(backend="vllm"))
    with pytest.raises(ValueError, match="EnginePool"):
        build_generators({agent.name: agent})
    with pytest.raises(RuntimeError, match="has no generator"):
        agent.generator  # noqa: B018


def test_warm_start_syncs_an_attached_generator(tiny_models_dir: Path) -> None:
    from mars2.data.sources import arithmetic
    from mars2.training.warm_start import WarmStartConfig, warm_start

    agent = _agent(tiny_models_dir / "tiny_llama", GenerationConfig(backend="vllm"))
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        agent.generator = build_generators({agent.name: agent}, pool)[agent.name]
        warm_start(agent, arithmetic("warm_start")[:4], WarmStartConfig(epochs=1, batch_size=4))
        assert not agent.generator.stale
        (llm,) = runtime.started
        for name, value in llm.model.state_dict().items():
            torch.testing.assert_close(value, agent.policy.state_dict()[name])


def test_warm_start_stops_at_its_target_loss(tiny_models_dir: Path) -> None:
    from mars2.data.sources import arithmetic
    from mars2.training.warm_start import WarmStartConfig, warm_start

    problems = arithmetic("warm_start")[:4]
    agent = _agent(tiny_models_dir / "tiny_llama", GenerationConfig())
    full = warm_start(agent, problems, WarmStartConfig(epochs=3, batch_size=4))
    assert len(full) == 3
    # The first epoch's mean loss is far above 0 and below 1e3: the target is met at once.
    early = warm_start(agent, problems, WarmStartConfig(epochs=3, batch_size=4, target_loss=1e3))
    assert len(early) == 1
    unmet = warm_start(agent, problems, WarmStartConfig(epochs=2, batch_size=4, target_loss=0.0))
    assert len(unmet) == 2


def test_warm_start_ends_when_its_stop_check_says_so(tiny_models_dir: Path) -> None:
    from mars2.data.sources import arithmetic
    from mars2.training.warm_start import WarmStartConfig, warm_start

    agent = _agent(tiny_models_dir / "tiny_llama", GenerationConfig())
    checks: list[tuple[int, float, int]] = []

    def stop(epoch: int, loss: float) -> bool:
        checks.append((epoch, loss, agent.weights_version))
        return epoch == 2

    config = WarmStartConfig(epochs=5, batch_size=4)
    losses = warm_start(agent, arithmetic("warm_start")[:4], config, stop=stop)
    assert len(losses) == 2
    assert [(epoch, loss) for epoch, loss, _ in checks] == [(1, losses[0]), (2, losses[1])]
    # Each check sees the weights marked changed, so a generator it uses serves the new ones.
    assert checks[1][2] > checks[0][2]


def test_warm_start_moves_the_kl_reference_with_it(tiny_models_dir: Path) -> None:
    """With β > 0 the KL must pull toward the warm-started policy, not the untrained one."""
    from mars2.data.sources import arithmetic
    from mars2.training.losses import LossConfig
    from mars2.training.warm_start import WarmStartConfig, warm_start

    path = tiny_models_dir / "tiny_llama"
    agent = AgentModule(
        path.name, ModelSpec(str(path)), GenerationConfig(), loss=LossConfig(beta=0.1)
    )
    before = {k: v.clone() for k, v in agent.policy.state_dict().items()}
    warm_start(agent, arithmetic("warm_start")[:4], WarmStartConfig(epochs=1, batch_size=4))
    (reference,) = agent._reference
    after = agent.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(value, after[name], rtol=0, atol=0)
    assert not any(p.requires_grad for p in reference.parameters())
    ids = torch.tensor([[1, 5, 6, 7]])
    mask = torch.ones_like(ids)
    logits = agent.policy(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(
        agent.reference_logprobs(ids, mask),
        token_logprobs(logits[:, :-1], ids[:, 1:]).detach(),
    )


def test_warm_start_with_lora_and_a_kl_term_is_refused(tiny_models_dir: Path) -> None:
    from mars2.data.sources import arithmetic
    from mars2.training.losses import LossConfig
    from mars2.training.warm_start import WarmStartConfig, warm_start

    path = tiny_models_dir / "tiny_llama"
    spec = ModelSpec(str(path), lora=LoraSpec(r=4, alpha=8))
    agent = AgentModule(path.name, spec, GenerationConfig(), loss=LossConfig(beta=0.1))
    with pytest.raises(ValueError, match="adapter"):
        warm_start(agent, arithmetic("warm_start")[:4], WarmStartConfig(epochs=1, batch_size=4))
