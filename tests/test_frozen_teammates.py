"""Frozen teammates (``agents.<name>.trainable: false``): they expand nodes, are never trained.

CPU, no vLLM. The in-process case trains tiny_pair with tiny_llama frozen on its own transformers
policy. The remote case puts the frozen teammate on an OpenAI-compatible endpoint; a small fake
HTTP server written here stands in for it (this venv has no vLLM and the machine no network;
tests/test_vllm_server.py serves a frozen teammate from a real vLLM server).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mars2.builders import build_agents
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import build_generators
from mars2.generation.transformers_backend import ScriptedGenerator
from mars2.generation.vllm_server import check_server_config, parse_completion
from mars2.generation.weight_transfer import ServerError
from mars2.models.loading import LoraSpec, ModelSpec
from mars2.rewards.routing import route_samples
from mars2.search.tree import load_trees
from mars2.training.run import build_run
from mars2.training.teammate import FrozenAgent
from mars2.utils.validation import ConfigError, check_trainable
from tests.test_training import compose_run, scripted_answer


def _train(cfg: Any) -> tuple[Any, Any, Any]:
    module, datamodule, trainer, sandbox = build_run(cfg)
    qwen = module.agents["tiny_qwen3"]  # scripted answers: mixed rewards from an untrained model
    qwen.generator = ScriptedGenerator(qwen.tokenizer, scripted_answer)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    finally:
        sandbox.close()
    return module, datamodule, trainer


@pytest.mark.slow
def test_an_in_process_frozen_teammate_expands_nodes_shapes_the_others_and_never_trains(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    first = tmp_path / "first"
    cfg = compose_run(first, tiny_models_dir, "steps=2", "logger=csv",
                      "agents.tiny_llama.trainable=false", "agents.tiny_llama.loss.beta=0.1",
                      "callbacks.checkpoint.every_n_train_steps=1")  # fmt: skip
    steps: list[Any] = []
    module, datamodule, trainer, sandbox = build_run(cfg)

    class Record(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            steps.append(datamodule.last)

    trainer.callbacks.append(Record())
    qwen = module.agents["tiny_qwen3"]
    qwen.generator = ScriptedGenerator(qwen.tokenizer, scripted_answer)
    llama = module.members()["tiny_llama"]
    assert isinstance(llama, FrozenAgent) and "tiny_llama" not in module.agents
    before = {k: v.clone() for k, v in llama.policy.state_dict().items()}
    try:
        trainer.fit(module, datamodule=datamodule)  # tiny_llama samples with its own policy
    finally:
        sandbox.close()

    # never trained: one optimizer (tiny_qwen3's), the frozen weights untouched, no gradients,
    # no KL reference even with beta > 0, no loss logged
    assert len(trainer.optimizers) == 1 and module.agent_names == ["tiny_qwen3"]
    assert all(torch.equal(before[k], v) for k, v in llama.policy.state_dict().items())
    assert not any(p.requires_grad for p in llama.policy.parameters())
    assert not hasattr(llama, "_reference")
    assert "tiny_qwen3/loss" in trainer.callback_metrics
    assert not [k for k in trainer.callback_metrics if k.startswith("tiny_llama/") and "loss" in k]
    assert len(steps) == 2
    for data in steps:
        # its nodes are in the trees, logged like anyone's, and train nobody
        frozen = [n for t in data.trees for n in t.answers() if n.agent == "tiny_llama"]
        assert frozen and all(n.completion.logprobs for n in frozen)  # sampled by its policy
        assert "tiny_llama/solve_rate" in data.metrics
        assert data.metrics["tiny_llama/expansion_share"] > 0
        assert data.metrics["trained_samples"] == len(data.samples["tiny_qwen3"])
        # the shaping and advantages are those of the whole tree, the frozen nodes included:
        # exactly what the team would get with tiny_llama trained
        again = route_samples(
            data.trees, ["tiny_qwen3", "tiny_llama"], datamodule.engine.advantages
        )
        assert again["tiny_qwen3"] == data.samples["tiny_qwen3"]
        # ... and each advantage is centred on the group of every answer of its tree
        config = datamodule.engine.advantages
        for index in {s.tree_index for s in data.samples["tiny_qwen3"]}:
            group = [s for samples in data.samples.values() for s in samples
                     if s.tree_index == index]  # fmt: skip
            scored = np.array([s.shaped_reward + s.length_term for s in group])
            for s in group:
                expected = (s.shaped_reward + s.length_term - scored.mean()) / (
                    scored.std(ddof=config.ddof) + config.eps
                )
                assert s.advantage == pytest.approx(expected)
    mixed = [t for d in steps for t in d.trees if {n.agent for n in t.answers()} == {
        "tiny_qwen3", "tiny_llama"} and len({n.reward for n in t.answers()}) > 1]  # fmt: skip
    assert mixed, "no tree had both agents' nodes with mixed rewards: the check above is empty"

    # the checkpoint holds the trained agent only; the exported agents likewise
    checkpoint = first / "checkpoints" / "step_000001.ckpt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert state["state_dict"] and not [k for k in state["state_dict"] if "tiny_llama" in k]
    assert len(state["optimizer_states"]) == 1
    assert (first / "agents" / "tiny_qwen3").is_dir() and not (
        first / "agents" / "tiny_llama"
    ).exists()

    # resume from step 1: the same batch as the uninterrupted run, the frozen teammate included
    second = tmp_path / "second"
    cfg = compose_run(second, tiny_models_dir, "steps=2", "logger=none",
                      "agents.tiny_llama.trainable=false", f"ckpt_path={checkpoint}",
                      "callbacks.checkpoint.every_n_train_steps=1")  # fmt: skip
    _, resumed, _ = _train(cfg)
    assert resumed.last.step == 1
    assert resumed.last.number == 2 and not (second / "trees" / "step_000001_rank0.jsonl").exists()
    original = load_trees(first / "trees" / "step_000002_rank0.jsonl")
    again_trees = load_trees(second / "trees" / "step_000002_rank0.jsonl")
    assert [[(n.agent, n.completion) for n in t.answers()] for t in again_trees] == [
        [(n.agent, n.completion) for n in t.answers()] for t in original
    ]

    # an evaluation of the run builds the frozen teammate again and loads the trained agent
    from mars2.eval.run import load_team

    cfg.ckpt_path = str(checkpoint)
    team = load_team(cfg)
    assert list(team.members()) == ["tiny_qwen3", "tiny_llama"]


class _OpenAI(BaseHTTPRequestHandler):
    """A fake OpenAI-compatible endpoint (not vLLM): /v1/chat/completions only, text answers,
    no token ids, no weight-transfer routes; it records every request."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(  # type: ignore[attr-defined]
            (self.path, body, self.headers.get("Authorization"))
        )
        if self.path == "/v1/chat/completions":
            text = scripted_answer(body["messages"])
            answer = {"choices": [{"message": {"role": "assistant", "content": text},
                                   "finish_reason": "stop"}]}  # fmt: skip
            data, code = json.dumps(answer).encode(), 200
        else:
            data, code = b'{"error": "not found"}', 404
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAI)
    server.requests = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.mark.slow
def test_a_frozen_teammate_on_an_openai_compatible_endpoint_joins_the_trees(
    tmp_path: Path, tiny_models_dir: Path, endpoint: ThreadingHTTPServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("TEAM_KEY", "s3cret")
    url = f"http://127.0.0.1:{endpoint.server_port}"
    cfg = compose_run(tmp_path, tiny_models_dir, "steps=1", "logger=none",
                      "callbacks.checkpoint.every_n_train_steps=1",
                      "agents.tiny_llama.trainable=false",
                      "agents.tiny_llama.generation.backend=vllm_server",
                      f"+agents.tiny_llama.generation.server={{urls:[{url}],api:chat,"
                      "model_name:hosted-model,api_key_env:TEAM_KEY}")  # fmt: skip
    module, datamodule, _ = _train(cfg)
    llama = module.members()["tiny_llama"]
    assert llama.policy is None  # only its tokenizer is in the trainer
    requests = endpoint.requests  # type: ignore[attr-defined]
    assert requests and {path for path, _, _ in requests} == {"/v1/chat/completions"}
    assert {body["model"] for _, body, _ in requests} == {"hosted-model"}
    assert {auth for _, _, auth in requests} == {"Bearer s3cret"}
    nodes = [n for t in datamodule.last.trees for n in t.answers() if n.agent == "tiny_llama"]
    assert len(nodes) == len(requests)
    for node in nodes:  # the answer's text, re-tokenised with the agent's tokenizer
        ids = llama.tokenizer.encode(node.completion.text, add_special_tokens=False)
        assert node.completion.token_ids == [*ids, llama.tokenizer.eos_token_id]
    assert datamodule.last.metrics["tiny_llama/solve_rate"] > 0  # the scripted answers solve some
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_frozen_settings_that_make_no_sense_are_refused(tiny_models_dir: Path) -> None:
    def agents(**extra: Any) -> Any:
        return OmegaConf.create({"agents": {
            "a": {"trainable": True, "model": {"path": "x"}},
            "b": {"trainable": False, "model": {"path": "x", **extra}},
        }})  # fmt: skip

    check_trainable(agents(), "train")
    everyone = agents()
    everyone.agents.a.trainable = False
    with pytest.raises(ConfigError, match="every agent is frozen"):
        check_trainable(everyone, "train")
    check_trainable(everyone, "eval")  # a frozen team is evaluated, not trained
    with pytest.raises(ConfigError, match=r"model\.lora"):
        check_trainable(agents(lora={"r": 4}), "train")
    loose = agents()
    loose.agents.b.trainable = "no"
    with pytest.raises(ConfigError, match="true or false"):
        check_trainable(loose, "train")
    spec = ModelSpec(str(tiny_models_dir / "tiny_llama"), lora=LoraSpec(r=4))
    with pytest.raises(ValueError, match=r"model\.lora"):
        FrozenAgent("b", spec)

    # a trained agent cannot be served frozen, nor by text (it needs token ids and log-probs)
    trained = build_agents(OmegaConf.create({"agents": {"a": {
        "_target_": "mars2.training.agent_module.AgentModule", "name": "a", "trainable": True,
        "model": {"_target_": "mars2.models.loading.ModelSpec",
                  "path": str(tiny_models_dir / "tiny_llama")},
    }}}))["a"]  # fmt: skip
    for server, message in (({"frozen": True}, "trainable=false"), ({"api": "chat"}, "api=chat")):
        trained.generation_config = GenerationConfig(
            backend="vllm_server", server={"urls": ["http://127.0.0.1:9"], **server})  # fmt: skip
        with pytest.raises(ValueError, match=message):
            build_generators({"a": trained}, EnginePool())
    with pytest.raises(ValueError, match="api_key_env"):
        check_server_config("a", {"api_key": "s3cret"})
    with pytest.raises(ValueError, match="not set"):
        check_server_config("a", {"api_key_env": "MARS2_SURELY_UNSET_VARIABLE"})
    with pytest.raises(ValueError, match="api="):
        check_server_config("a", {"api": "responses"})


def test_a_completion_without_token_ids_is_retokenised_for_a_frozen_teammate_only(
    tiny_models_dir: Path,
) -> None:
    from mars2.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_models_dir / "tiny_llama"))
    answer = {"choices": [{"text": "print(1)", "finish_reason": "length"}]}
    with pytest.raises(ServerError, match="return_token_ids"):
        parse_completion([1, 2], answer)  # a trained agent: refused
    completion = parse_completion([1, 2], answer, tokenizer)  # a frozen teammate
    assert completion.token_ids == tokenizer.encode("print(1)", add_special_tokens=False)
    assert completion.truncated and completion.logprobs is None


FAKE_VLLM = """#!{python}
# A stand-in for vLLM's API server (this venv has no vLLM): records its command line, answers
# /health, and nothing else.
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
open(os.environ["FAKE_ARGS"], "w").write(" ".join(sys.argv[1:]))
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
"""


def test_a_launched_server_for_a_frozen_teammate_takes_no_weight_transfer(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    """mars2 launches the frozen teammate's server without --weight-transfer-config and never
    calls it to sync (a fake interpreter stands in for vLLM's)."""
    import sys

    fake, args = tmp_path / "fake_python", tmp_path / "args"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    config = GenerationConfig(backend="vllm_server", max_new_tokens=4, server={
        "python": str(fake), "env": {"FAKE_ARGS": str(args)}, "health_timeout_s": 60})  # fmt: skip
    agent = FrozenAgent("tiny_llama", ModelSpec(str(tiny_models_dir / "tiny_llama")), config)
    with EnginePool(log_dir=tmp_path / "servers") as pool:
        generator = build_generators({"tiny_llama": agent}, pool)["tiny_llama"]
        launched = generator.backend.launched
        assert launched.alive() and generator.backend.frozen
        assert not generator.catch_up()  # never stale, never synced
    command = args.read_text()
    assert "-m vllm.entrypoints.openai.api_server" in command
    assert f"--model {tiny_models_dir / 'tiny_llama'}" in command
    assert "--weight-transfer-config" not in command and "--enable-lora" not in command
    assert not launched.alive()  # the pool stopped the server it launched
