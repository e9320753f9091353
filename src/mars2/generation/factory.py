"""Build every agent's generator in one place, serving the agent's current weights from the start.

`build_generators` picks the backend from each agent's `GenerationConfig` (vLLM engines come
from the run's `EnginePool`, LoRA agents on one base share an engine when asked), pushes the
agent's current weights in, and returns `ServedGenerator`s. A `ServedGenerator` remembers which
version of its agent's weights it serves and refuses to sample from an older one. With
``streaming=True`` (the pipelined driver) vLLM agents get engines fed request by request
(`mars2.generation.vllm_async`), served by a `StreamingServedGenerator` with the same guarantee.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mars2.generation.base import Completion, DoneCallback, Messages, StreamingGenerator
from mars2.generation.config import GenerationConfig
from mars2.generation.engines import EnginePool
from mars2.generation.prompt import encode_prompt
from mars2.generation.reference import AnswerKey, ReferenceGenerator
from mars2.utils.validation import streaming_tensor_parallel_error


class GenerationSource(Protocol):
    """What a generator is built from: an agent's policy, tokenizer, model and settings.

    `weights_version` counts the changes to the policy's weights (optimizer steps, loads, warm
    starts); a generator is current when it serves the latest version.
    """

    name: str
    model_spec: Any
    tokenizer: Any
    policy: Any  # None for a frozen teammate on a server (`trainable` False)
    generation_config: GenerationConfig
    weights_version: int


class StaleWeightsError(RuntimeError):
    """A generator was asked to sample from weights older than its agent's current ones."""


class ServedGenerator:
    """An agent's generator: a backend plus the version of the agent's weights it serves."""

    def __init__(self, source: GenerationSource, backend: Any, served_version: int | None = None,
                 config: GenerationConfig | None = None) -> None:  # fmt: skip
        self.source = source
        self.backend = backend
        self.served_version = served_version
        self.config = config or source.generation_config

    @property
    def stale(self) -> bool:
        """True when the agent's weights changed since the last sync."""
        return self.served_version != self.source.weights_version

    def sync(self) -> None:
        """Push the agent's current weights into the backend."""
        self.backend.sync_weights(self.source.policy)
        self.served_version = self.source.weights_version

    def catch_up(self) -> bool:
        """Sync if the agent's weights changed since the last sync; says whether it synced."""
        if not self.stale:
            return False
        self.sync()
        return True

    def _ready(self) -> None:
        """Refuse stale weights; wake an engine that slept with its weights discarded."""
        if self.stale:
            raise StaleWeightsError(
                f"agent {self.source.name!r} is at weights version {self.source.weights_version} "
                f"but its {type(self.backend).__name__} serves version {self.served_version}: "
                "sync after every change of its weights (MultiAgentCallback does after each step)"
            )
        if getattr(self.backend, "asleep", False):  # slept with its weights discarded: the
            self.backend.sync_weights(self.source.policy)  # current ones go back in, never old

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        self._ready()
        return list(self.backend.generate(chats))

    def encode_prompt(self, chat: Messages) -> list[int]:
        return encode_prompt(self.source.tokenizer, chat, self.config.max_prompt_tokens)

    @property
    def weights_version(self) -> int | None:
        return self.served_version


class StreamingServedGenerator(ServedGenerator):
    """A `ServedGenerator` whose backend takes requests while it generates (`StreamingGenerator`).

    Every `submit` is checked like `generate`: never stale weights, never a sleeping engine.
    """

    @property
    def max_in_flight(self) -> int:
        return int(self.backend.max_in_flight)

    def submit(self, chats: Sequence[Messages], done: DoneCallback) -> None:
        self._ready()
        self.backend.submit(chats, done)

    def release(self) -> None:
        """The pipelined driver is done with it for this rollout (a vLLM engine may sleep)."""
        release = getattr(self.backend, "release", None)
        if release is not None:
            release()


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def build_generators(
    sources: Mapping[str, GenerationSource],
    pool: EnginePool | None = None,
    temperature: float | None = None,
    answer_key: AnswerKey | None = None,
    streaming: bool = False,
) -> dict[str, ServedGenerator]:
    """A generator per agent, each already serving its agent's current weights.

    `temperature` overrides the agents' sampling temperature (evaluation). vLLM agents need the
    run's `pool`, which owns their engines and must be closed by the run; `reference` agents need
    the run's `answer_key` (see mars2.generation.reference). `streaming` (for the pipelined
    driver) feeds vLLM engines request by request; other backends are unaffected.
    """
    shared: dict[str, list[GenerationSource]] = {}
    for source in sources.values():
        cfg = source.generation_config
        if cfg.shared_base:
            if source.model_spec.lora is None:
                raise ValueError(
                    f"agent {source.name!r}: vllm.shared_base serves LoRA agents: set model.lora"
                )
            shared.setdefault(_base_key(source), []).append(source)
    generators = {}
    for name, source in sources.items():
        cfg = source.generation_config
        if temperature is not None:
            cfg = dataclasses.replace(cfg, temperature=temperature)
        backend = _backend(source, cfg, pool, shared, answer_key, streaming)
        served = (
            StreamingServedGenerator if isinstance(backend, StreamingGenerator) else ServedGenerator
        )
        generator = served(source, backend, config=cfg)
        generator.sync()
        generators[name] = generator
    return generators


def _base_key(source: GenerationSource) -> str:
    return f"shared:{source.model_spec.path}:{source.model_spec.dtype}"


def _backend(source: GenerationSource, cfg: GenerationConfig, pool: EnginePool | None,
             shared: dict[str, list[GenerationSource]],
             answer_key: AnswerKey | None = None, streaming: bool = False) -> Any:  # fmt: skip
    if cfg.backend == "reference":
        if answer_key is None:
            raise ValueError(
                f"agent {source.name!r} answers with reference solutions: build its generator "
                "with the run's problems (build_generators(..., answer_key=AnswerKey.of(...)))"
            )
        return ReferenceGenerator(answer_key)
    if cfg.backend == "vllm_server":
        return _server_backend(source, cfg, pool)
    if cfg.backend == "transformers":
        from mars2.generation.transformers_backend import TransformersGenerator

        return TransformersGenerator(
            source.policy,
            source.tokenizer,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            batch_size=cfg.batch_size,
            max_prompt_tokens=cfg.max_prompt_tokens,
        )
    if pool is None:
        raise ValueError(
            f"agent {source.name!r} samples with vLLM: build its generator with the run's "
            "EnginePool (build_generators(agents, pool))"
        )
    from mars2.generation.vllm_backend import (
        SharedBaseLoRAGenerator,
        VLLMGenerator,
        engine_args,
    )

    world = _world_size()
    tp = int((cfg.vllm or {}).get("tensor_parallel_size") or 1)
    if streaming and tp > 1:
        raise ValueError(streaming_tensor_parallel_error(source.name, tp))
    if cfg.shared_base:
        key = _base_key(source)
        group = shared[key]
        args = engine_args(source.model_spec, cfg, lora_slots=len(group), world_size=world,
                           max_lora_r=max(s.model_spec.lora.r for s in group))  # fmt: skip
        llm = pool.engine(key, args)
        adapters = pool.workdir() / source.name
        adapters.mkdir(parents=True, exist_ok=True)
        if streaming:
            from mars2.generation.vllm_async import StreamingSharedBaseLoRAGenerator

            return StreamingSharedBaseLoRAGenerator(llm, pool.runtime, source.tokenizer, cfg,
                                                    adapters, pool.lora_ids(key), pool.loop())  # fmt: skip
        return SharedBaseLoRAGenerator(llm, pool.runtime, source.tokenizer, cfg, adapters,
                                       pool.lora_ids(key), pool.engine_group(tp),
                                       source.name)  # fmt: skip
    key = f"agent:{source.name}"
    llm = pool.engine(key, engine_args(source.model_spec, cfg, world_size=world))
    if streaming:
        from mars2.generation.vllm_async import StreamingVLLMGenerator

        return StreamingVLLMGenerator(llm, pool.runtime, source.tokenizer, cfg, pool.loop())
    return VLLMGenerator(llm, pool.runtime, source.tokenizer, cfg, pool.engine_group(tp), key)


def _server_backend(
    source: GenerationSource, cfg: GenerationConfig, pool: EnginePool | None
) -> Any:
    """An agent on vLLM servers: launched for it (owned by the run's `pool`) or at given urls."""
    from mars2.generation.vllm_server import VLLMServerGenerator, check_server_config, launch_server

    server = check_server_config(source.name, cfg.server)
    trainable = bool(getattr(source, "trainable", True))
    if server.get("frozen") and trainable:
        raise ValueError(
            f"agent {source.name!r}: generation.server.frozen is set but the agent is trained: a "
            f"teammate that is never trained is agents.{source.name}.trainable=false (the trainer "
            "then loads only its tokenizer and never pushes weights)"
        )
    server["frozen"] = not trainable
    if trainable and server["api"] != "tokens":
        raise ValueError(
            f"agent {source.name!r}: generation.server.api={server['api']} sends text, and a "
            "trained agent needs token ids in and token ids + log-probs out (api=tokens, a vLLM "
            f"server); only a frozen teammate (agents.{source.name}.trainable=false) may use it"
        )
    if cfg.top_p < 1 and trainable:
        raise ValueError(
            f"agent {source.name!r}: top_p={cfg.top_p} on vLLM servers: the server's log-probs are "
            "renormalised over the kept tokens, which biases the importance ratio against the "
            "trainer's full-vocabulary log-probs; set top_p=1.0 for a trained agent (a frozen "
            "teammate, trainable: false, may keep it)"
        )
    lora = getattr(source.model_spec, "lora", None)
    if pool is None:
        raise ValueError(
            f"agent {source.name!r} samples from vLLM servers: build its generator with the run's "
            "EnginePool (build_generators(agents, pool)), which owns the servers and their threads"
        )
    describe = lambda url: f"server {url}"  # noqa: E731
    launched = None
    if server.get("urls"):
        urls = list(server["urls"])
    else:
        launched = launch_server(source.name, source.model_spec, server, pool.server_log_dir(),
                                 lora_rank=int(lora.r) if lora is not None else 0)  # fmt: skip
        pool.on_close(launched.stop)
        urls = [launched.url]
        describe = lambda url: launched.describe()  # noqa: E731
    adapters = None
    if lora is not None:
        adapters = pool.workdir() / f"adapters-{source.name}"
        adapters.mkdir(parents=True, exist_ok=True)
    generator = VLLMServerGenerator(source.name, source.tokenizer, cfg, urls, server,
                                    lora=lora is not None, adapter_dir=adapters,
                                    describe=describe)  # fmt: skip
    generator.launched = launched
    pool.on_close(generator.close)
    return generator
