"""vLLM generators (``pip install '.[gpu]'``), behind the same interface as the transformers one.

Engines run in the trainer's process, colocated with training, and are started by the run's
`EnginePool`. After each optimizer step the trainer's weights go in through vLLM's supported
in-place reload (``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``:
vLLM's own loaders then repack, shard for tensor parallelism and post-process them), streamed one
full tensor at a time (`streamed_weights`), the prefix cache is reset (cached KV blocks belong to
the old weights), and with sleep mode the engine's memory is released while the trainer runs.
With ``vllm.tensor_parallel_size: k`` each group of k ranks shares one engine per agent, every
rank one tensor-parallel worker; their calls go through the group's `EngineGroup`. Log-probs of the sampled tokens come back as vLLM sampled them (``processed_logprobs``: after
temperature), for truncated importance sampling.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mars2.generation.base import Completion, Messages
from mars2.generation.config import GenerationConfig
from mars2.generation.engine_group import EngineGroup
from mars2.generation.prompt import encode_prompt, encode_prompt_noting_cut, marked

# The LoRA ranks vLLM accepts for max_lora_rank; an adapter of lower rank is served as is.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Keys of GenerationConfig.vllm that are ours, not engine arguments.
OUR_KEYS = ("shared_base", "enable_sleep_mode", "sleep_level")


def lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of rank `r`."""
    for accepted in LORA_RANKS:
        if r <= accepted:
            return accepted
    raise ValueError(f"LoRA rank {r} is above the largest rank vLLM serves ({LORA_RANKS[-1]})")


def sleep_level(config: GenerationConfig) -> int | None:
    """The sleep level the engine uses between rollouts, or None without sleep mode."""
    extra = config.vllm or {}
    if not extra.get("enable_sleep_mode"):
        return None
    level = int(extra.get("sleep_level", 2))
    if level not in (1, 2):
        raise ValueError(f"vllm.sleep_level must be 1 or 2, got {level}")
    return level


def engine_args(
    model_spec: Any,
    config: GenerationConfig,
    *,
    lora_slots: int = 0,
    max_lora_r: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """The `vllm.LLM` arguments for an agent (or, with `lora_slots`, for LoRA agents on one base).

    Under DDP (`world_size` > 1) every rank owns its own engine through vLLM's
    ``external_launcher`` executor, which joins the trainer's process group instead of spawning
    workers. ``GenerationConfig.vllm`` entries other than ours override the defaults here.
    """
    extra = {k: v for k, v in (config.vllm or {}).items() if k not in OUR_KEYS}
    mode = extra.pop("logprobs_mode", "processed_logprobs")
    if mode != "processed_logprobs":
        raise ValueError(
            f"vllm.logprobs_mode={mode!r}: importance sampling needs the log-probs of the "
            "distribution actually sampled ('processed_logprobs')"
        )
    args: dict[str, Any] = {
        "model": model_spec.path,
        "dtype": model_spec.dtype,
        "trust_remote_code": model_spec.trust_remote_code,
        "gpu_memory_utilization": 0.3,
        "enable_prefix_caching": True,
        "enable_sleep_mode": sleep_level(config) is not None,
        "logprobs_mode": mode,
    }
    if lora_slots:
        args.update(enable_lora=True, max_loras=lora_slots, max_lora_rank=lora_rank(max_lora_r))
    if world_size > 1:
        args["distributed_executor_backend"] = "external_launcher"
    length = config.max_model_len  # the memory check sized the KV cache for this length
    if length is not None:
        wanted = (config.max_prompt_tokens or 0) + config.max_new_tokens
        if config.max_prompt_tokens is not None and length < wanted:
            raise ValueError(
                f"vllm.max_model_len={length} is shorter than generation.max_prompt_tokens + "
                f"max_new_tokens = {wanted}: the engine would cut completions the trainer and "
                "the memory check count in full; raise vllm.max_model_len or drop it (it then "
                "defaults to their sum)"
            )
        args["max_model_len"] = length
        extra.pop("max_model_len", None)
    tp = int(extra.get("tensor_parallel_size") or 1)
    if tp > 1 and world_size == 1:
        raise ValueError(
            f"vllm.tensor_parallel_size={tp} needs {tp} trainer ranks (e.g. trainer.devices={tp}): "
            "each rank is one tensor-parallel worker of the engine, which must run in the "
            "trainer's processes to take its weights by reference"
        )
    args.update(extra)
    return args


def _check_group(config: GenerationConfig, group: EngineGroup | None) -> None:
    if group is not None and group.size > 1 and sleep_level(config) is not None:
        raise ValueError(
            "vllm.enable_sleep_mode with tensor_parallel_size > 1: a tensor-parallel engine stays "
            "awake between rollouts (its group's weights are reloaded together at each sync); "
            "set scale.enable_sleep_mode=false"
        )


def _sampling(runtime: Any, config: GenerationConfig, seed: int | None = None) -> Any:
    return runtime.sampling(
        n=1,
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_new_tokens,
        logprobs=0,  # the sampled token's log-prob
        seed=seed,
    )


def _group_request(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Prompts with one sampling seed each, for the ranks of a tensor-parallel group.

    Every rank of the group samples each token itself (external_launcher runs a scheduler and a
    sampler per rank); unseeded requests draw from the process's global generator, which the ranks'
    different work (the leader's search) moves apart, and ranks sampling different tokens would
    feed the engine's collectives different inputs. So the leader seeds every request (from the
    trainer's seeded torch generator) and the seeds travel with its prompts.
    """
    import torch

    return prompts, torch.randint(0, 2**62, (len(prompts),)).tolist()


def _params(runtime: Any, config: GenerationConfig, default: Any, seeds: list[int] | None) -> Any:
    """`default` for every request, or one sampling per request with its group seed."""
    return default if seeds is None else [_sampling(runtime, config, s) for s in seeds]


class _EngineRequests:
    """What both vLLM generators share: prompt encoding, and where a batch of prompts runs (the
    generator's own engine, or its tensor-parallel group, whose ranks all run the leader's seeded
    prompts)."""

    tokenizer: Any
    max_prompt_tokens: int | None
    group: EngineGroup | None
    key: str

    def encode_prompt(self, chat: Messages) -> list[int]:
        return encode_prompt(self.tokenizer, chat, self.max_prompt_tokens)

    def encode_noting_cut(self, chat: Messages) -> tuple[list[int], bool]:
        return encode_prompt_noting_cut(self.tokenizer, chat, self.max_prompt_tokens)

    def _generate_batch(self, chats: Sequence[Messages]) -> list[Completion]:
        encoded = [self.encode_noting_cut(c) for c in chats]
        prompts, cuts = [ids for ids, _ in encoded], [cut for _, cut in encoded]
        if self.group is not None:
            return marked(list(self.group.call(self.key, _group_request(prompts))), cuts)
        return marked(self._generate_ids((prompts, None)), cuts)

    def _generate_ids(self, request: tuple[list[list[int]], list[int] | None]) -> list[Completion]:
        raise NotImplementedError


class VLLMGenerator(_EngineRequests):
    """One agent's own engine; `sync_weights(policy)` reloads the trainer's weights into it.

    With sleep mode the engine sleeps after each generation (level 2 discards its weights and KV
    cache); a sync wakes the weight memory, reloads, then wakes the KV cache, as vLLM documents for
    RL. An engine whose weights were discarded refuses to generate until it is synced again.
    """

    def __init__(self, llm: Any, runtime: Any, tokenizer: Any, config: GenerationConfig,
                 group: EngineGroup | None = None, key: str = "") -> None:  # fmt: skip
        _check_group(config, group)
        self.llm = llm
        self.runtime, self.config = runtime, config
        self.tokenizer = tokenizer
        self.max_prompt_tokens = config.max_prompt_tokens
        self.sampling = _sampling(runtime, config)
        self.sleep_level = sleep_level(config)
        self.asleep = False
        self.weights_version = 0
        self.group, self.key = group, key
        if group is not None:
            group.register(key, self._generate_ids)

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        if self.asleep:
            raise RuntimeError(
                "the vLLM engine is asleep and holds no valid weights: sync_weights(policy) first"
            )
        return self._generate_batch(chats)

    def _generate_ids(self, request: tuple[list[list[int]], list[int] | None]) -> list[Completion]:
        prompts, seeds = request
        params = _params(self.runtime, self.config, self.sampling, seeds)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)  # fmt: skip
        completions = [
            _completion(prompt, output.outputs[0])
            for prompt, output in zip(prompts, outputs, strict=True)
        ]
        if self.sleep_level is not None:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
        return completions

    def sync_weights(self, policy: Any) -> None:
        """Reload the trainer's weights (LoRA merged in) and drop KV blocks of the old ones."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache stays released during the reload
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": streamed_weights(policy), "is_checkpoint_format": True},
        )
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        self.weights_version += 1


def _whole(tensor: Any) -> Any:
    """A full tensor: gathered from its shards (FSDP2 DTensor; a collective) or as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor.detach()


def _lora_modules(policy: Any) -> dict[str, Any]:
    """peft's LoRA layers by module name (none for a policy without adapters)."""
    if not hasattr(policy, "peft_config"):
        return {}
    return {name: m for name, m in policy.named_modules() if hasattr(m, "lora_A")}


def _merged(base: Any, layer: Any, adapter: str) -> Any:
    """base + B @ A x scaling, as peft's merge computes it, without touching the policy."""
    if getattr(layer, "use_dora", {}).get(adapter):
        raise NotImplementedError("syncing a DoRA adapter into vLLM is not supported")
    delta = (
        _whole(layer.lora_B[adapter].weight).float() @ _whole(layer.lora_A[adapter].weight).float()
    )
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return (base.float() + delta * layer.scaling[adapter]).to(base.dtype)


def streamed_weights(policy: Any) -> Iterator[tuple[str, Any]]:
    """(name, full tensor) pairs in the base model's naming, produced one at a time.

    A sharded (FSDP2) tensor is gathered only when its turn comes and a LoRA adapter is merged into
    its base weight on the fly (the policy itself is never modified), so beyond what is resident a
    sync holds one full tensor and its merged copy, plus what the engine buffers while it loads.
    Every rank must consume it whole, in the same order (the gathers are collectives).
    """
    lora = _lora_modules(policy)
    adapter = getattr(policy, "active_adapter", "default")
    for name, tensor in policy.state_dict().items():
        if "lora_" in name:
            continue  # merged into their base weights below
        full = _whole(tensor)
        if name.endswith(".base_layer.weight"):
            layer = lora.get(name.removesuffix(".base_layer.weight"))
            if layer is not None and adapter in layer.lora_A:
                full = _merged(full, layer, adapter)
        yield name.removeprefix("base_model.model.").replace(".base_layer", ""), full
        del full  # before the next tensor is gathered


def merged_weights(policy: Any) -> list[tuple[str, Any]]:
    """Every (name, full tensor) pair of `streamed_weights` at once (tests, small models)."""
    return list(streamed_weights(policy))


def adapter_state(policy: Any) -> dict[str, Any]:
    """A peft policy's adapter tensors, whole (gathered from FSDP2 shards; every rank calls it)."""
    return {name: _whole(t) for name, t in policy.state_dict().items() if "lora_" in name}


class SharedBaseLoRAGenerator(_EngineRequests):
    """LoRA agents on one base share one engine (built with ``enable_lora``), each with its adapter.

    `sync_weights` saves the agent's current adapter under `adapter_dir` and switches to a fresh
    LoRA request id so vLLM loads the new weights; the previous adapter is unloaded and deleted.
    """

    def __init__(
        self,
        llm: Any,
        runtime: Any,
        tokenizer: Any,
        config: GenerationConfig,
        adapter_dir: Path,
        lora_ids: Iterable[int],
        group: EngineGroup | None = None,
        key: str = "",
    ) -> None:
        if sleep_level(config) is not None:
            raise ValueError(
                "a shared-base LoRA engine cannot sleep: its base weights are never reloaded"
            )
        self.llm = llm
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.max_prompt_tokens = config.max_prompt_tokens
        self.config = config
        self.sampling = _sampling(runtime, config)
        self.adapter_dir = adapter_dir
        self._ids = iter(lora_ids)
        self._request: Any = None
        self._path: Path | None = None
        self.weights_version = 0
        self.group, self.key = group, key
        if group is not None:
            group.register(key, self._generate_ids)

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        if self._request is None:
            raise RuntimeError(
                "call sync_weights(policy) once before generating: the adapter is not loaded yet"
            )
        return self._generate_batch(chats)

    def _generate_ids(self, request: tuple[list[list[int]], list[int] | None]) -> list[Completion]:
        prompts, seeds = request
        params = _params(self.runtime, self.config, self.sampling, seeds)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    lora_request=self._request, use_tqdm=False)  # fmt: skip
        return [
            _completion(prompt, output.outputs[0])
            for prompt, output in zip(prompts, outputs, strict=True)
        ]

    def sync_weights(self, policy: Any) -> None:
        lora_id = next(self._ids)
        path = self.adapter_dir / f"lora_{lora_id}"
        # a PEFT model saves just its adapter; sharded adapters are gathered first
        policy.save_pretrained(str(path), state_dict=adapter_state(policy))
        old_request, old_path = self._request, self._path
        self._request = self.runtime.lora_request(f"{self.adapter_dir.name}-{lora_id}", lora_id,
                                                  str(path))  # fmt: skip
        self._path = path
        if old_request is not None:
            self.llm.llm_engine.remove_lora(old_request.lora_int_id)
        if old_path is not None:
            shutil.rmtree(old_path, ignore_errors=True)
        self.weights_version += 1


def _completion(prompt: list[int], sample: Any) -> Completion:
    tokens = list(sample.token_ids)
    logprobs = [
        step[token].logprob for step, token in zip(sample.logprobs or [], tokens, strict=False)
    ]
    return Completion(
        text=sample.text,
        prompt_token_ids=prompt,
        token_ids=tokens,
        logprobs=logprobs if len(logprobs) == len(tokens) else None,
        truncated=sample.finish_reason == "length",
    )
