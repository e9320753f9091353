"""Load policies, reference models and tokenizers from a local path or a hub id, with clear errors."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model, tokenizer or chat template that cannot be used; says which and why."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapter settings (peft)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


@dataclass(frozen=True)
class ModelSpec:
    """Where a policy comes from and how to load it."""

    path: str
    dtype: str = "float32"
    lora: LoraSpec | None = None
    quantization: str | None = None  # None, "4bit" or "8bit" (bitsandbytes, GPU only)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # sizes for the memory estimate (mars2.models.memory) when no local config.json is at `path`
    architecture: dict[str, Any] | None = None
    # build from `path`/config.json with random weights (no weight files needed): memory
    # calibration (mars2.training.calibration) and tests, never a real run
    random_init: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {sorted(_DTYPES)}")
        if self.quantization not in (None, "4bit", "8bit"):
            raise ValueError(
                f"unknown quantization {self.quantization!r}: use null, '4bit' or '8bit'"
            )
        if self.random_init and self.quantization:
            raise ValueError("random_init builds an unquantised model: set quantization=null")


def _check_source(path: str) -> None:
    looks_local = path.startswith((".", "/", "~")) or (os.sep in path and path.count("/") != 1)
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    if (looks_local or offline) and not Path(path).expanduser().exists():
        hint = (
            " (offline: only local paths work; run `make models` for the tiny agents)"
            if offline
            else ""
        )
        raise ModelLoadError(f"model path {path!r} does not exist{hint}")


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The agent's own tokenizer; it must have a chat template and gets a pad token if it lacks one."""
    from transformers import AutoTokenizer

    _check_source(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {err}") from err
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(
            f"tokenizer at {path!r} has no chat template; agents need one to be prompted"
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelLoadError(f"tokenizer at {path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(spec: ModelSpec, inference_only: bool = False) -> Any:
    """The trainable causal LM (optionally quantised and wrapped with a LoRA adapter);
    `inference_only` (a frozen teammate) also takes a quantised base without an adapter."""
    from transformers import AutoModelForCausalLM

    _check_source(spec.path)
    kwargs: dict[str, Any] = {
        "dtype": _DTYPES[spec.dtype],
        "trust_remote_code": spec.trust_remote_code,
        **spec.extra,
    }
    if spec.attn_implementation:
        kwargs["attn_implementation"] = spec.attn_implementation
    if spec.quantization:
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"quantization={spec.quantization!r} needs a CUDA GPU (bitsandbytes)"
            )
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=spec.quantization == "4bit",
            load_in_8bit=spec.quantization == "8bit",
            bnb_4bit_compute_dtype=_DTYPES[spec.dtype],
        )
    model: Any
    try:
        if spec.random_init:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(spec.path, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load a causal LM from {spec.path!r}: {err}") from err
    if spec.quantization and spec.lora is None and not inference_only:
        raise ModelLoadError(
            "a quantized base can only be trained through a LoRA adapter: set model.lora"
        )
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if spec.lora is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=spec.lora.r,
            lora_alpha=spec.lora.alpha,
            lora_dropout=spec.lora.dropout,
            target_modules=list(spec.lora.target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
    return model


def frozen_copy(model: Any) -> Any:
    """A reference model: an independent copy with gradients off, in eval mode."""
    import copy

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return ref
