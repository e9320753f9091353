"""`FrozenAgent`: a teammate that expands nodes like any member and is never trained.

``agents.<name>.trainable: false`` builds one (`mars2.builders.build_agents`). It has no
optimizer, no KL reference, no loss and no checkpointed state, and its weights are never synced.
On a server (``generation.backend: vllm_server``, launched or at ``urls``, any OpenAI-compatible
endpoint with ``server.api: chat``) the trainer loads only its tokenizer (prompts go out as token
ids, answers are recorded as token ids); with an in-process backend (``transformers``, ``vllm``)
its policy is loaded once, in eval mode with gradients off. Its nodes stay in the trees: they
shape everyone's rewards, join the advantage groups and the search's agent statistics, and its
solve rate and expansion share are logged; its own samples train nobody.
"""

from __future__ import annotations

import logging
from typing import Any

from mars2.generation.config import GenerationConfig
from mars2.models.loading import ModelSpec, load_policy, load_tokenizer
from mars2.training.members import GeneratorSlot
from mars2.utils.validation import frozen_agent_error

log = logging.getLogger(__name__)

# Backends whose engine runs in the trainer's processes and samples from the trainer's policy.
IN_PROCESS = ("transformers", "vllm")


class FrozenAgent(GeneratorSlot):
    """A teammate at fixed weights: name, tokenizer, generation settings, and its policy only when
    an in-process backend samples from it. `optim`, `loss` and `micro_batch_size` are accepted
    (every agent config has them) and not used."""

    trainable = False

    def __init__(
        self,
        name: str,
        model: ModelSpec,
        generation: GenerationConfig | None = None,
        optim: Any = None,
        loss: Any = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.name = name
        self.model_spec = model
        self.generation_config = generation or GenerationConfig()
        error = frozen_agent_error(name, model.lora)
        if error is not None:
            raise ValueError(error)
        self.tokenizer = load_tokenizer(model.path, model.trust_remote_code)
        self.policy: Any = None
        if self.generation_config.backend in IN_PROCESS:
            self.policy = load_policy(model, inference_only=True)
            self.policy.requires_grad_(False)
            self.policy.eval()
            self.policy.config.use_cache = True
        self.weights_version = 0  # never changes: its generator is never stale
        self._generator = None
        ignored = [k for k, v in (("optim", optim), ("loss", loss)) if v is not None]
        log.info(
            "agent %s is frozen (trainable: false): never trained, synced or checkpointed%s; %s",
            name,
            f", its {' and '.join(ignored)} settings are not used" if ignored else "",
            "its policy is loaded for in-process generation"
            if self.policy is not None
            else "only its tokenizer is loaded",
        )

    @property
    def overlong(self) -> None:
        """No length term: the overlong penalty shapes an agent's own training samples."""
        return None
