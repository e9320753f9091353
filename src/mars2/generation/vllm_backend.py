"""A vLLM generator (GPU only; ``pip install 'mars2[gpu]'``), behind the same interface.

One in-process engine per agent, colocated with training: after each optimizer step the trainer's
weights are loaded into the engine (`sync_weights`), the prefix cache is reset (cached KV blocks
belong to the old weights), and with ``enable_sleep_mode`` the engine's memory is released while
the trainer runs. Log-probs of the sampled tokens come back for truncated importance sampling.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

from mars2.generation.base import Completion, Messages
from mars2.generation.prompt_ids import encode_prompt as _encode_prompt


def _engine_model(llm: Any) -> Any:
    """The torch model inside an in-process vLLM engine (the attribute path moved across versions)."""
    executor = llm.llm_engine.model_executor
    worker = executor.driver_worker
    worker = getattr(worker, "worker", worker)
    return worker.model_runner.model


class VLLMGenerator:
    """Samples with vLLM; `sync_weights(policy)` pushes the trainer's current weights in."""

    def __init__(self, model_spec: Any, tokenizer: Any, config: Any) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "generation.backend=vllm needs the gpu extra: pip install 'mars2[gpu]'"
            ) from err
        # Weight loading reaches into the engine: keep it in this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        extra = dict(config.vllm or {})
        self.sleep_mode = bool(extra.pop("enable_sleep_mode", False))
        self.llm = vllm.LLM(
            model=model_spec.path,
            dtype=model_spec.dtype,
            gpu_memory_utilization=extra.pop("gpu_memory_utilization", 0.3),
            enable_prefix_caching=extra.pop("enable_prefix_caching", True),
            enable_sleep_mode=self.sleep_mode,
            max_model_len=extra.pop("max_model_len", None),
            trust_remote_code=model_spec.trust_remote_code,
            **extra,
        )
        self.sampling = vllm.SamplingParams(
            n=1,
            temperature=config.temperature,
            top_p=config.top_p,
            max_tokens=config.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob
        )
        self.tokenizer = tokenizer
        self.max_prompt_tokens = config.max_prompt_tokens
        self.weights_version = 0
        self._asleep = False

    def encode_prompt(self, chat: Messages) -> list[int]:
        return _encode_prompt(self.tokenizer, chat, self.max_prompt_tokens)

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        prompts = [self.encode_prompt(c) for c in chats]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self.sampling, use_tqdm=False
        )
        completions = [
            _completion(prompt, output.outputs[0])
            for prompt, output in zip(prompts, outputs, strict=True)
        ]
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._asleep = True
        return completions

    def sync_weights(self, policy: Any) -> None:
        """Load the trainer's weights (LoRA merged in) into the engine and drop stale KV cache."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        _engine_model(self.llm).load_weights(merged_weights(policy))
        self.llm.reset_prefix_cache()
        self.weights_version += 1


def merged_weights(policy: Any) -> list[tuple[str, Any]]:
    """(name, tensor) pairs in the base model's naming; a LoRA adapter is merged in and out again."""
    if not hasattr(policy, "peft_config"):
        return [(name, p.detach()) for name, p in policy.state_dict().items()]
    policy.merge_adapter()
    try:
        weights = []
        for name, p in policy.state_dict().items():
            if "lora_" in name:
                continue
            clean = name.removeprefix("base_model.model.").replace(".base_layer", "")
            weights.append((clean, p.detach().clone()))
        return weights
    finally:
        policy.unmerge_adapter()


class SharedBaseLoRAGenerator:
    """Agents that share a base model share one vLLM engine, each sampling through its own adapter.

    The engine is created once per base path (``enable_lora``); `sync_weights` saves the agent's
    current adapter to disk and switches to a fresh LoRA request id so vLLM loads the new weights.
    """

    _engines: ClassVar[
        dict[str, Any]
    ] = {}  # base model path -> engine, shared by agents on that base

    def __init__(self, model_spec: Any, tokenizer: Any, config: Any, adapter_dir: str) -> None:
        try:
            import vllm
            from vllm.lora.request import LoRARequest
        except ImportError as err:
            raise ImportError(
                "generation.backend=vllm needs the gpu extra: pip install 'mars2[gpu]'"
            ) from err
        if model_spec.lora is None:
            raise ValueError("a shared-base engine serves LoRA agents: set model.lora")
        extra = dict(config.vllm or {})
        extra.pop("shared_base", None)
        if model_spec.path not in self._engines:
            self._engines[model_spec.path] = vllm.LLM(
                model=model_spec.path, dtype=model_spec.dtype, enable_lora=True,
                max_lora_rank=model_spec.lora.r, gpu_memory_utilization=extra.pop("gpu_memory_utilization", 0.3),
                enable_prefix_caching=extra.pop("enable_prefix_caching", True), **extra,
            )  # fmt: skip
        self.llm = self._engines[model_spec.path]
        self._request_type = LoRARequest
        self.sampling = vllm.SamplingParams(n=1, temperature=config.temperature, top_p=config.top_p,
                                            max_tokens=config.max_new_tokens, logprobs=0)  # fmt: skip
        self.tokenizer = tokenizer
        self.adapter_dir = adapter_dir
        self.max_prompt_tokens = config.max_prompt_tokens
        self.weights_version = 0
        self._request: Any = None
        self._next_id = abs(hash(adapter_dir)) % 1_000_000 * 1000 + 1

    def encode_prompt(self, chat: Messages) -> list[int]:
        return _encode_prompt(self.tokenizer, chat, self.max_prompt_tokens)

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        if self._request is None:
            raise RuntimeError(
                "call sync_weights(policy) once before generating: the adapter is not loaded yet"
            )
        prompts = [self.encode_prompt(c) for c in chats]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.sampling,
                                    lora_request=self._request, use_tqdm=False)  # fmt: skip
        return [
            _completion(prompt, output.outputs[0])
            for prompt, output in zip(prompts, outputs, strict=True)
        ]

    def sync_weights(self, policy: Any) -> None:
        path = f"{self.adapter_dir}/v{self.weights_version + 1}"
        policy.save_pretrained(path)  # a PEFT model saves just its adapter
        self._request = self._request_type(
            f"{self.adapter_dir}-{self._next_id}", self._next_id, path
        )
        self._next_id += 1
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
