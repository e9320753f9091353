"""Streaming vLLM generators (`mars2.generation.vllm_async`) on a fake engine (vLLM cannot run here;
`make test-vllm` runs them on a real one): every request handed back once, as it finishes; weight
syncs only between rollouts; sleep and wake; failures and cancellation reach every caller; the
pipelined driver on streaming engines."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mars2.generation.base import Completion, StreamingGenerator
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.factory import StaleWeightsError, StreamingServedGenerator, build_generators
from mars2.generation.vllm_async import CancelledError, StreamingVLLMGenerator
from mars2.generation.vllm_backend import VLLMGenerator
from mars2.models.loading import LoraSpec, ModelSpec
from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.simulation.environment import SimulatedGrader, simulated_problems
from mars2.training.agent_module import AgentModule
from tests.fakes.vllm_engine import FakeLLM, FakeRuntime

CHAT = [{"role": "user", "content": "Write a program."}]


def _agent(path: Path, **vllm: Any) -> AgentModule:
    config = GenerationConfig(backend="vllm", max_new_tokens=4, vllm=vllm or None)
    return AgentModule(path.name, ModelSpec(str(path)), config)


def _greedy(agent: AgentModule, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = agent.policy.eval().generate(torch.tensor([prompt]), do_sample=False,
                                           max_new_tokens=tokens, min_new_tokens=tokens)  # fmt: skip
    return out[0, len(prompt) :].tolist()


class Collector:
    """A `done` callback that records what arrives, and can hold the engine's thread."""

    def __init__(self) -> None:
        self.arrived: list[tuple[int, Completion | BaseException]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.all_done = threading.Event()
        self.expected = 0

    def __call__(self, index: int, output: Completion | BaseException) -> None:
        self.arrived.append((index, output))
        if len(self.arrived) == self.expected:
            self.all_done.set()
        self.hold.wait()


def _submit_lengths(
    generator: StreamingServedGenerator, lengths: list[int], done: Collector
) -> None:
    """One request per length (the fake engine decodes `max_tokens` tokens, one per step)."""
    backend = generator.backend
    base = dict(backend.sampling)
    done.expected += len(lengths)
    for length in lengths:
        backend.sampling = {**base, "max_tokens": length}
        generator.submit([CHAT], done)
    backend.sampling = base


def test_streaming_generator_hands_back_every_request_once_as_it_finishes(
    tiny_models_dir: Path,
) -> None:
    agent = _agent(tiny_models_dir / "tiny_qwen3")
    with EnginePool(FakeRuntime()) as pool:
        generators = build_generators({agent.name: agent}, pool, streaming=True)
        generator = generators[agent.name]
        assert isinstance(generator, StreamingServedGenerator)
        assert isinstance(generator, StreamingGenerator)
        assert isinstance(generator.backend, StreamingVLLMGenerator)
        done = Collector()
        lengths = [9, 2, 6, 1, 4]
        _submit_lengths(generator, lengths, done)
        assert done.all_done.wait(60)
        # Each request once; they arrive in order of length, not of submission.
        assert [len(c.token_ids) for _, c in done.arrived] == sorted(lengths)  # type: ignore[union-attr]
        assert [i for i, _ in done.arrived] == [0] * len(lengths)  # one chat per submit
        prompt = generator.encode_prompt(CHAT)
        for _, completion in done.arrived:
            assert isinstance(completion, Completion)
            assert completion.prompt_token_ids == prompt
            assert completion.token_ids == _greedy(agent, prompt, len(completion.token_ids))
            assert completion.logprobs == [-1.0] * len(completion.token_ids)
        # The blocking generate goes through the same engine loop, in the order asked.
        completions = generator.generate([CHAT, CHAT[:1]])
        assert [len(c.token_ids) for c in completions] == [4, 4]
        assert generator.backend.loop.in_flight == 0


def test_only_vllm_agents_of_a_pipelined_run_stream(tiny_models_dir: Path) -> None:
    vllm_agent = _agent(tiny_models_dir / "tiny_qwen3")
    local = AgentModule("local", ModelSpec(str(tiny_models_dir / "tiny_llama")), GenerationConfig())
    with EnginePool(FakeRuntime()) as pool:
        rounds = build_generators({vllm_agent.name: vllm_agent}, pool)
        assert type(rounds[vllm_agent.name].backend) is VLLMGenerator
        assert not isinstance(rounds[vllm_agent.name], StreamingGenerator)
    with EnginePool(FakeRuntime()) as pool:
        piped = build_generators({"q": vllm_agent, "local": local}, pool, streaming=True)
        assert isinstance(piped["q"], StreamingGenerator)
        assert not isinstance(piped["local"], StreamingGenerator)  # transformers: a batch thread


def test_a_sync_waits_for_the_rollout_and_stale_weights_are_refused(tiny_models_dir: Path) -> None:
    agent = _agent(tiny_models_dir / "tiny_llama")
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        generator = build_generators({agent.name: agent}, pool, streaming=True)[agent.name]
        done = Collector()
        done.hold.clear()  # the engine's thread stops in the first callback: 8 tokens still to go
        _submit_lengths(generator, [1, 8], done)
        while not done.arrived:
            pass
        agent.mark_weights_changed()
        with pytest.raises(RuntimeError, match="1 requests in flight"):
            generator.catch_up()
        assert generator.stale
        with pytest.raises(StaleWeightsError):
            generator.submit([CHAT], done)  # never sampled from old weights
        done.hold.set()
        assert done.all_done.wait(60)
        (llm,) = runtime.started
        assert generator.catch_up() and not generator.stale
        assert ("reload_weights",) in llm.calls
        for name, value in llm.model.state_dict().items():
            torch.testing.assert_close(value, agent.policy.state_dict()[name])


def test_a_sleeping_streaming_engine_sleeps_at_release_and_wakes_into_current_weights(
    tiny_models_dir: Path,
) -> None:
    agent = _agent(tiny_models_dir / "tiny_llama", enable_sleep_mode=True)
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        generator = build_generators({agent.name: agent}, pool, streaming=True)[agent.name]
        (llm,) = runtime.started
        done = Collector()
        _submit_lengths(generator, [2, 3], done)
        assert done.all_done.wait(60)
        assert ("sleep", 2) not in llm.calls  # never in the middle of a rollout
        generator.release()  # the pipelined driver is done with it
        assert llm.calls[-1] == ("sleep", 2) and generator.backend.asleep
        with pytest.raises(RuntimeError, match="asleep"):
            generator.backend.submit([CHAT], done)
        llm.calls.clear()
        again = Collector()
        _submit_lengths(generator, [1], again)  # wakes it: the current weights are pushed in
        assert again.all_done.wait(60)
        assert [c[0] for c in llm.calls[:4]] == ["wake_up", "reload_weights", "wake_up",
                                                 "reset_prefix_cache"]  # fmt: skip
        assert not generator.stale
        generator.generate([CHAT])  # a blocking call sleeps after, as the synchronous engine
        assert llm.calls[-1] == ("sleep", 2)


def test_release_cancels_what_a_failed_rollout_left_in_flight(tiny_models_dir: Path) -> None:
    agent = _agent(tiny_models_dir / "tiny_qwen3")
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        generator = build_generators({agent.name: agent}, pool, streaming=True)[agent.name]
        done = Collector()
        done.hold.clear()
        # The long ones first: they are in the engine before the short one can finish.
        _submit_lengths(generator, [50, 60, 1], done)
        while not done.arrived:
            pass
        releasing = threading.Thread(target=generator.release)
        releasing.start()
        while not generator.backend.loop._cancel:  # asked to cancel while the two are running
            pass
        done.hold.set()
        releasing.join(60)
        assert done.all_done.wait(60)
        cancelled = [o for _, o in done.arrived if isinstance(o, CancelledError)]
        assert len(cancelled) == 2  # the two long ones, each told once
        (llm,) = runtime.started
        assert any(c[0] == "abort" for c in llm.calls) and not llm.llm_engine.running
        assert generator.backend.loop.in_flight == 0
        generator.sync()  # idle again: syncs are allowed


def test_an_engine_failure_reaches_every_waiting_request(tiny_models_dir: Path) -> None:
    agent = _agent(tiny_models_dir / "tiny_qwen3")
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        generator = build_generators({agent.name: agent}, pool, streaming=True)[agent.name]
        (llm,) = runtime.started
        llm.llm_engine.fail_next_step = OSError("device lost")
        with pytest.raises(OSError, match="device lost"):
            generator.generate([CHAT, CHAT, CHAT])
        assert generator.backend.loop.in_flight == 0
        assert len(generator.generate([CHAT])) == 1  # the loop starts again for new work


def test_lora_agents_on_a_shared_base_stream_through_one_loop(tiny_models_dir: Path) -> None:
    lora = LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    config = GenerationConfig(backend="vllm", max_new_tokens=3, vllm={"shared_base": True})
    path = tiny_models_dir / "tiny_qwen3"
    agents = {n: AgentModule(n, ModelSpec(str(path), lora=lora), config) for n in ("a", "b")}
    runtime = FakeRuntime()
    with EnginePool(runtime) as pool:
        generators = build_generators(agents, pool, streaming=True)
        assert generators["a"].backend.loop is generators["b"].backend.loop
        done = Collector()
        done.expected = 4
        generators["a"].submit([CHAT, CHAT], done)
        generators["b"].submit([CHAT, CHAT], done)
        assert done.all_done.wait(60)
        assert sorted(i for i, _ in done.arrived) == [0, 0, 1, 1]


def test_pipelined_driver_grows_full_trees_on_streaming_engines(tiny_models_dir: Path) -> None:
    agents = {name: _agent(tiny_models_dir / name) for name in ("tiny_qwen3", "tiny_llama")}
    runtime = FakeRuntime(step_seconds=0.002)  # steps long enough to overlap, were two threads
    with EnginePool(runtime) as pool:
        generators = build_generators(agents, pool, streaming=True)
        search = TreeSearch(SearchConfig(max_nodes=5, expansions_per_round=3, driver="pipelined"))
        trees = search.grow(simulated_problems(4), generators, SimulatedGrader(),
                            np.random.default_rng(0), step=3)  # fmt: skip
        assert all(len(t) == 5 for t in trees)
        for tree in trees:
            for node in tree.answers():
                assert len(node.completion.token_ids) == 4 and node.step == 3
                assert node.completion.prompt_token_ids == generators[
                    node.agent or ""
                ].encode_prompt(node.messages)
        added = sum(c[0] == "add_request" for llm in runtime.started for c in llm.calls)
        assert added == 4 * 5  # one request per node, none lost or repeated
        assert 0 < search.timings.busy["tiny_qwen3"] <= search.timings.span
        assert all(isinstance(llm, FakeLLM) for llm in runtime.started)
        assert runtime.stepping.peak == 1  # the two engines stepped in turn, never at once
