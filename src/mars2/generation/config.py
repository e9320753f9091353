"""`GenerationConfig`: how one agent samples and which backend serves it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings and which backend serves this agent.

    ``vllm`` holds extra vLLM engine arguments plus three of ours: ``shared_base`` (LoRA agents on
    one base share one engine, each through its own adapter), ``enable_sleep_mode`` (release the
    engine's memory while the trainer runs) and ``sleep_level`` (2 by default, as vLLM documents
    for RL: the weights are discarded and reloaded from the trainer at the next sync).
    """

    backend: str = "transformers"  # transformers | vllm
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 32
    max_prompt_tokens: int | None = None
    vllm: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("transformers", "vllm"):
            raise ValueError(
                f"unknown generation backend {self.backend!r}: use 'transformers' or 'vllm'"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")

    @property
    def shared_base(self) -> bool:
        """LoRA agents on one base model share one vLLM engine."""
        return self.backend == "vllm" and bool((self.vllm or {}).get("shared_base"))
