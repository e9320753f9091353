"""`GenerationConfig`: how one agent samples and which backend serves it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKENDS = ("transformers", "vllm", "vllm_server", "reference")


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings and which backend serves this agent.

    ``vllm`` holds extra vLLM engine arguments plus three of ours: ``shared_base`` (LoRA agents on
    one base share one engine, each through its own adapter), ``enable_sleep_mode`` (release the
    engine's memory while the trainer runs) and ``sleep_level`` (2 by default, as vLLM documents
    for RL: the weights are discarded and reloaded from the trainer at the next sync).
    ``server`` configures ``backend: vllm_server`` (an engine as a vLLM server, launched by mars2 or
    at ``urls``; see `mars2.generation.vllm_server` for its keys).
    """

    backend: str = "transformers"  # transformers | vllm | vllm_server | reference
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 32
    max_prompt_tokens: int | None = None
    vllm: dict[str, Any] | None = None
    server: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown generation backend {self.backend!r}: use one of {', '.join(BACKENDS)}"
            )
        if self.server is not None and self.backend != "vllm_server":
            raise ValueError(
                f"generation.server is set but generation.backend={self.backend!r}: set "
                "backend=vllm_server to sample from vLLM servers (or drop generation.server)"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (int(value) != value or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value}")

    @property
    def max_model_len(self) -> int | None:
        """The tokens one sequence may take in an engine: `vllm.max_model_len` when given, else
        prompt cap + completion cap (`max_prompt_tokens` + `max_new_tokens`); None when neither is
        set (vLLM then takes the model's own, e.g. 40,960 for Qwen3-32B). The memory check
        (`mars2.training.memory.agent_plan`) and the engine (`engine_args`) both read this."""
        given = (self.vllm or {}).get("max_model_len")
        if given:
            return int(given)
        if self.max_prompt_tokens is None:
            return None
        return int(self.max_prompt_tokens) + int(self.max_new_tokens)

    @property
    def shared_base(self) -> bool:
        """LoRA agents on one base model share one vLLM engine."""
        return self.backend == "vllm" and bool((self.vllm or {}).get("shared_base"))
