"""``generation.backend=vllm_server`` against real vLLM servers on CPU (`make test-vllm`).

The trainer is this process (the main venv, no vLLM); the servers run from the vLLM venv named by
``MARS2_VLLM_PYTHON`` (`make test-vllm` sets it to .venv-vllm's python). A server takes ~100 s to
become healthy on the loaded 2-core CI machine, so the module shares ONE server (enforce-eager,
LoRA enabled and the ``gloo`` weight-transfer backend configured) and kills it in its last test.
Skipped where no vLLM interpreter is given, unless MARS2_REQUIRE_VLLM is set (then it fails).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mars2.generation.base import Completion
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import ServedGenerator, build_generators
from mars2.generation.server_guard import group_members
from mars2.generation.vllm_server import LaunchedServer, check_server_config, launch_server
from mars2.generation.weight_transfer import ServerError, http_json
from mars2.models.loading import LoraSpec, ModelSpec
from mars2.training.agent_module import AgentModule
from mars2.training.teammate import FrozenAgent

VLLM_PYTHON = os.environ.get("MARS2_VLLM_PYTHON")
if not VLLM_PYTHON and os.environ.get("MARS2_REQUIRE_VLLM"):
    raise RuntimeError("MARS2_REQUIRE_VLLM is set but MARS2_VLLM_PYTHON names no interpreter")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM interpreter: run `make test-vllm`"),
]
SERVER_ARGS = {"max-model-len": 512, "enforce-eager": True, "max-num-seqs": 16}
CHATS = [
    [{"role": "user", "content": "Write a program that prints a number."}],
    [{"role": "user", "content": "def add(a, b):"}],
]
# gloo on CPU; scripts/gpu_check_server.sh sets nccl on a GPU machine (the same trainer code)
TRANSFER = os.environ.get("MARS2_WEIGHT_TRANSFER", "gloo")
LORA = LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj"))


@pytest.fixture(scope="module")
def server(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    spec = ModelSpec(str(tiny_models_dir / "tiny_llama"))
    config = check_server_config("tiny_llama", {
        "python": VLLM_PYTHON,
        "args": {**SERVER_ARGS, "enable-lora": True, "max-lora-rank": 8,
                 "weight-transfer-config": {"backend": TRANSFER}},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "health_timeout_s": 900,
    })  # fmt: skip
    launched = launch_server("tiny_llama", spec, config, tmp_path_factory.mktemp("servers"))
    yield launched
    launched.stop()


def _agent(tiny: Path, url: str, lora: bool = False, tokens: int = 8,
           frozen: bool = False) -> Any:  # fmt: skip
    """tiny_llama on the module's server: trained (`AgentModule`) or a frozen teammate (only its
    tokenizer in this process)."""
    spec = ModelSpec(str(tiny / "tiny_llama"), lora=LORA if lora else None)
    config = GenerationConfig(backend="vllm_server", max_new_tokens=tokens, temperature=1.0,
                              server={"urls": [url], "model_name": "tiny_llama",
                                      "weight_transfer": TRANSFER})  # fmt: skip
    if frozen:
        return FrozenAgent("tiny_llama", spec, config)
    return AgentModule("tiny_llama", spec, config)


def greedy_server(generator: ServedGenerator, prompt: list[int], tokens: int) -> list[int]:
    backend = generator.backend
    body = {"model": backend.model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    answer = http_json(f"{backend.endpoints.urls[0]}/v1/completions", body, timeout=120)
    return [int(t) for t in answer["choices"][0]["token_ids"]]


def greedy_transformers(policy: Any, prompt: list[int], tokens: int) -> list[int]:
    policy.eval()
    with torch.no_grad():
        out = policy.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=tokens,
                              min_new_tokens=tokens)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _gone(group: int, within_s: float = 15.0) -> bool:
    """No live process of `group` is left (polled: processes killed a moment ago may still exit)."""
    deadline = time.monotonic() + within_s
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not group_members(group)


def _perturb(agent: AgentModule, seed: int, only: str = "") -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in agent.policy.named_parameters():
            if only in name:
                p.add_(torch.randn_like(p) * (0.5 if only else 0.1))
    agent.mark_weights_changed()


def test_launched_server_is_healthy_and_answers_token_ids_with_logprobs(
    server: LaunchedServer, tiny_models_dir: Path
) -> None:
    assert server.alive() and server.log_path.stat().st_size > 0
    http_json(f"{server.url}/health", timeout=10, method="GET")
    agent = _agent(tiny_models_dir, server.url, frozen=True)
    with EnginePool() as pool:
        generator = build_generators({"a": agent}, pool)["a"]
        out = generator.generate(CHATS)
    assert [len(c.token_ids) > 0 for c in out] == [True, True]
    for c in out:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.prompt_token_ids == generator.encode_prompt(CHATS[out.index(c)])


def test_lora_adapter_is_hot_loaded_under_a_new_name_and_decodes_like_transformers(
    server: LaunchedServer, tiny_models_dir: Path
) -> None:  # runs before the base weights are replaced below (the adapter sits on the base)
    agent = _agent(tiny_models_dir, server.url, lora=True)
    _perturb(agent, 2, only="lora_B")
    with EnginePool() as pool:
        generator = build_generators({"a": agent}, pool)["a"]
        prompt = generator.encode_prompt(CHATS[0])
        first = generator.backend.model
        assert greedy_server(generator, prompt, 8) == greedy_transformers(agent.policy, prompt, 8)
        _perturb(agent, 3, only="lora_B")
        assert generator.catch_up()
        assert generator.backend.model != first
        served = {m["id"] for m in http_json(f"{server.url}/v1/models", timeout=30)["data"]}
        assert generator.backend.model in served and first not in served  # the old one unloaded
        assert greedy_server(generator, prompt, 8) == greedy_transformers(agent.policy, prompt, 8)


def test_full_weights_through_the_gloo_backend_decode_like_transformers(
    server: LaunchedServer, tiny_models_dir: Path
) -> None:
    agent = _agent(tiny_models_dir, server.url)
    with EnginePool() as pool:
        generator = build_generators({"a": agent}, pool)["a"]
        prompts = [generator.encode_prompt(c) for c in CHATS]
        before = [greedy_server(generator, p, 10) for p in prompts]
        _perturb(agent, 1)
        assert generator.catch_up()
        after = [greedy_server(generator, p, 10) for p in prompts]
        assert after == [greedy_transformers(agent.policy, p, 10) for p in prompts]
        assert after != before
        info = http_json(f"{server.url}/weight_info", timeout=30)
        assert info["weight_version"] == f"tiny_llama-{generator.backend.weights_version}"


def test_update_in_flight_with_mode_keep_loses_no_request(
    server: LaunchedServer, tiny_models_dir: Path
) -> None:
    agent = _agent(tiny_models_dir, server.url, tokens=48)
    with EnginePool() as pool:
        generator = build_generators({"a": agent}, pool, streaming=True)["a"]
        results: dict[int, Completion | BaseException] = {}
        finished = threading.Event()

        def done(index: int, result: Completion | BaseException) -> None:
            results[index] = result
            if len(results) == 8:
                finished.set()

        generator.submit(CHATS * 4, done)
        time.sleep(0.5)  # requests are running on the server
        _perturb(agent, 4)
        generator.backend.sync_weights(agent.policy)  # pause(mode=keep), update, resume
        generator.served_version = agent.weights_version
        assert finished.wait(300)
    assert sorted(results) == list(range(8))
    assert all(isinstance(r, Completion) and r.token_ids for r in results.values()), results


def test_tiny_pair_trains_three_steps_with_both_agents_on_servers(
    server: LaunchedServer, tiny_models_dir: Path, tmp_path: Path
) -> None:
    """tiny_llama on the module's server (urls), tiny_qwen3 on a server the run launches itself
    from its config; the run stops that one at its end, and each server took every step's weights."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir

    from mars2.training.run import build_run

    repo = Path(__file__).resolve().parents[1]
    args = "{max-model-len:512,enforce-eager:true,max-num-seqs:16}"
    with initialize_config_dir(config_dir=str(repo / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "experiment=tiny_pair", "steps=3", f"paths.output_dir={tmp_path}",
            f"paths.tiny_models_dir={tiny_models_dir}", f"paths.log_dir={tmp_path}/logs",
            "logger=none", "~callbacks.progress", "+trainer.enable_progress_bar=false",
            "sandbox.num_workers=2",
            "agents.tiny_llama.generation.backend=vllm_server",
            f"+agents.tiny_llama.generation.server={{urls:[{server.url}],model_name:tiny_llama}}",
            "agents.tiny_qwen3.generation.backend=vllm_server",
            f"+agents.tiny_qwen3.generation.server={{python:{VLLM_PYTHON},args:{args},"
            "env:{VLLM_CPU_KVCACHE_SPACE:1},health_timeout_s:900}",
        ])  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    steps: list[dict[str, float]] = []
    launched: list[Any] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            steps.append(dict(datamodule.last.metrics))
            launched[:] = [module.agents["tiny_qwen3"].generator.backend.launched]

    trainer.callbacks.append(Record())
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    assert len(steps) == 3 and sum(s["trained_samples"] for s in steps) > 0
    info = http_json(f"{server.url}/weight_info", timeout=30)
    assert info["weight_version"].startswith("tiny_llama-")
    with pytest.raises(ServerError):  # the run stopped the server it launched
        http_json(f"{launched[0].url}/health", timeout=5, method="GET")
    assert _gone(launched[0].pid)  # with every process of its group: no orphans
    assert (tmp_path / "servers" / "tiny_qwen3.log").stat().st_size > 0


def test_a_frozen_teammate_on_a_server_by_url_expands_nodes_and_is_never_synced(
    server: LaunchedServer, tiny_models_dir: Path, tmp_path: Path
) -> None:
    """tiny_llama frozen (trainable=false) on the module's server, tiny_qwen3 trained in-process
    (scripted answers, no warm start: mixed rewards in seconds): the trainer holds only
    tiny_llama's tokenizer, its nodes come from the server (with the server's log-probs) and the
    server's weights are never touched."""
    import lightning.pytorch as pl

    from mars2.generation.transformers_backend import ScriptedGenerator
    from mars2.training.run import build_run
    from tests.test_training import compose_run, scripted_answer

    cfg = compose_run(tmp_path, tiny_models_dir, "steps=2", "logger=none",
                      "callbacks.checkpoint=null", "agents.tiny_llama.trainable=false",
                      "agents.tiny_llama.generation.backend=vllm_server",
                      f"+agents.tiny_llama.generation.server={{urls:[{server.url}],"
                      "model_name:tiny_llama}")  # fmt: skip
    version = http_json(f"{server.url}/weight_info", timeout=30)["weight_version"]
    module, datamodule, trainer, sandbox = build_run(cfg)
    qwen = module.agents["tiny_qwen3"]
    qwen.generator = ScriptedGenerator(qwen.tokenizer, scripted_answer)
    llama = module.members()["tiny_llama"]
    assert isinstance(llama, FrozenAgent) and llama.policy is None
    steps: list[Any] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            steps.append(datamodule.last)

    trainer.callbacks.append(Record())
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    assert len(steps) == 2 and len(trainer.optimizers) == 1
    assert "tiny_qwen3/loss" in trainer.callback_metrics  # the trained agent trained alongside
    nodes = [n for d in steps for t in d.trees for n in t.answers() if n.agent == "tiny_llama"]
    assert nodes and all(n.completion.logprobs is not None for n in nodes)
    assert all(len(n.completion.logprobs) == len(n.completion.token_ids) for n in nodes)
    assert "tiny_llama/solve_rate" in steps[-1].metrics
    assert not [k for k in trainer.callback_metrics if k.startswith("tiny_llama/") and "loss" in k]
    assert http_json(f"{server.url}/weight_info", timeout=30)["weight_version"] == version


def test_a_server_that_dies_fails_its_pending_requests_with_its_log_tail(
    server: LaunchedServer, tiny_models_dir: Path
) -> None:  # the module's last test: it kills the shared server
    agent = _agent(tiny_models_dir, server.url, tokens=256, frozen=True)
    with EnginePool() as pool:
        generator = build_generators({"a": agent}, pool)["a"]
        generator.backend._describe = lambda url: server.describe()
        # long answers, so that the kill lands while every request is still decoding
        generator.backend.request_hook = lambda body: body.update(
            max_tokens=400, min_tokens=400, ignore_eos=True
        )
        errors: list[BaseException] = []

        def run() -> None:
            try:
                generator.generate(CHATS * 16)
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=run)
        thread.start()
        while generator.backend.endpoints.in_flight() == 0:
            time.sleep(0.05)
        time.sleep(0.5)  # the server is generating
        os.killpg(server.pid, signal.SIGKILL)
        thread.join(120)
    assert errors and isinstance(errors[0], ServerError), errors
    assert "last lines of the log" in str(errors[0])
    assert "vllm.entrypoints.openai.api_server" in str(errors[0])
    server.stop()
    assert _gone(server.pid)  # nothing of its process group is left


def test_a_server_that_never_becomes_healthy_fails_fast_naming_its_command_and_log(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    config = check_server_config("bad", {"python": VLLM_PYTHON,
                                         "args": {"max-model-len": "not-a-number"},
                                         "health_timeout_s": 300})  # fmt: skip
    start = time.monotonic()
    with pytest.raises(ServerError, match="exited with code") as err:
        launch_server("bad", ModelSpec(str(tiny_models_dir / "tiny_llama")), config, tmp_path)
    assert time.monotonic() - start < 120  # vLLM's import alone takes a while on a busy machine
    assert "--max-model-len not-a-number" in str(err.value) and "bad.log" in str(err.value)
