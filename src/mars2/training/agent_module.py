"""`AgentModule`: one agent's policy, reference model, tokenizer, optimizer and GRPO-family loss."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from mars2.generation.config import GenerationConfig
from mars2.models.export import export_pretrained
from mars2.models.hidden import forward_with_head, output_head
from mars2.models.loading import ModelSpec, frozen_copy, load_policy, load_tokenizer
from mars2.rewards.overlong import OverlongPenalty
from mars2.training.logprobs import chunked_logprobs_and_entropy
from mars2.training.losses import LossConfig, policy_loss, token_entropy, token_logprobs
from mars2.training.members import GeneratorSlot, forget_earlier_steps, next_batch

__all__ = ["AgentModule", "GenerationConfig", "OptimConfig", "advance_schedule", "optimise_agent"]


@dataclass(frozen=True)
class OptimConfig:
    """AdamW (or bitsandbytes AdamW8bit) with linear warm-up then constant or cosine decay.

    One rollout feeds `ppo_epochs` x `mini_batches` optimizer steps: each epoch passes over the
    rollout's samples split into `mini_batches` parts. After the first step the policy is no
    longer the one that sampled, so the ratio to the rollout-time log-probs moves and clipping
    acts. The schedule counts team steps (rollouts): `warmup_steps` and `total_steps` are team
    steps, every update of a rollout uses its team step's LR (verl likewise steps its scheduler
    once per training step), and an agent that sits a step out still moves along its schedule.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    optimizer: str = "adamw"  # adamw | adamw8bit
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine
    total_steps: int = 1000
    grad_clip: float | None = 1.0
    ppo_epochs: int = 1
    mini_batches: int = 1

    def __post_init__(self) -> None:
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError("ppo_epochs and mini_batches must be >= 1")
        if self.optimizer not in ("adamw", "adamw8bit"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}: use 'adamw' or 'adamw8bit'")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"unknown schedule {self.schedule!r}: use 'constant' or 'cosine'")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


class AgentModule(GeneratorSlot, pl.LightningModule):
    """One agent. Alone it trains as plain single-agent GRPO; in a team it is a child module.

    A teammate that is never trained (``trainable: false``) is a `mars2.training.teammate.FrozenAgent`.
    """

    trainable = True

    def __init__(
        self,
        name: str,
        model: ModelSpec,
        generation: GenerationConfig | None = None,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        micro_batch_size: int = 8,
    ) -> None:
        super().__init__()
        self.name = name
        self.model_spec = model
        self.generation_config = generation or GenerationConfig()
        self.optim_config = optim or OptimConfig()
        self.loss_config = loss or LossConfig()
        self.micro_batch_size = micro_batch_size
        self.tokenizer = load_tokenizer(model.path, model.trust_remote_code)
        self.policy = load_policy(model)
        self.policy.config.use_cache = True
        self.policy.train()  # from_pretrained returns eval mode
        # The reference is kept out of the module tree: it is never trained and never checkpointed.
        self._reference: list[Any] = []
        self.snapshot_reference()
        self._generator = None
        # Counts changes to the policy's weights (optimizer steps, loads, warm starts); the
        # generator records the version it serves and refuses to sample from an older one.
        self.weights_version = 0
        # Set by the run when generation overlaps the updates (max_staleness > 0): samples may
        # come from older weights, so the sampler's log-probs feed truncated importance sampling.
        self.off_policy_samples = False
        self.register_load_state_dict_post_hook(AgentModule._weights_loaded)
        self.automatic_optimization = False

    # -- reference and generation -----------------------------------------------------------

    def snapshot_reference(self) -> None:
        """Make the KL reference a frozen copy of the policy as it is now (full fine-tuning with
        β > 0; with LoRA the reference is the base with the adapter off). Called at construction
        and again after a warm start, so the KL pulls toward the warm-started policy."""
        if self.loss_config.beta > 0 and self.model_spec.lora is None:
            self._reference.clear()  # the old copy goes first: never three models at once
            self._reference.append(frozen_copy(self.policy))

    def reference_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor | None:
        """Log-probs of the frozen reference (the base with the adapter off when LoRA is on)."""
        if self.loss_config.beta == 0:
            return None
        with torch.no_grad():
            if self.model_spec.lora is not None:
                with self.policy.disable_adapter():
                    return self.next_token_logprobs(self.policy, input_ids, attention_mask)[0]
            ref = self._reference[0]
            if next(ref.parameters()).device != input_ids.device:
                ref.to(input_ids.device)
            return self.next_token_logprobs(ref, input_ids, attention_mask)[0]

    def next_token_logprobs(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p of each next token, its entropy or None), [B, T-1] at the sampling temperature.

        The output head runs `loss.logprob_chunk_tokens` tokens at a time (no [tokens, vocab]
        logits are held); models whose logits are more than the head's output are computed whole.
        """
        temperature = self.generation_config.temperature
        targets = input_ids[:, 1:]
        chunk = self.loss_config.logprob_chunk_tokens
        head = output_head(model) if chunk else None
        if head is None:
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
            logprobs = token_logprobs(logits, targets, temperature)
            if not with_entropy:
                return logprobs, None
            with torch.no_grad():
                return logprobs, token_entropy(logits, temperature)
        found: dict[str, torch.Tensor] = {}

        def chunked(hidden: torch.Tensor) -> torch.Tensor:
            logprobs, entropy = chunked_logprobs_and_entropy(hidden[:, :-1], head.weight, targets,
                                                             temperature, chunk, head.bias,
                                                             with_entropy)  # fmt: skip
            if entropy is not None:
                found["entropy"] = entropy
            return logprobs

        # inside the model's forward: under FSDP2 the head's weight is whole only there
        return forward_with_head(model, head, chunked, input_ids, attention_mask), found.get(
            "entropy"
        )

    def mark_weights_changed(self) -> None:
        """Record that the policy's weights changed: the generator must be synced before sampling."""
        self.weights_version += 1

    @staticmethod
    def _weights_loaded(module: Any, incompatible_keys: Any) -> None:
        module.mark_weights_changed()

    def _optimizer_stepped(self, optimizer: Any, *args: Any) -> None:
        # A step at lr 0 leaves the weights as they were: torch.distributed.checkpoint steps an
        # optimizer that has no state yet (an agent that has not trained) that way to create it.
        if any(float(group.get("lr", 1.0)) != 0.0 for group in optimizer.param_groups):
            self.mark_weights_changed()

    @property
    def overlong(self) -> OverlongPenalty | None:
        """This agent's soft overlong reward term (None when its buffer is 0)."""
        if self.loss_config.overlong_buffer == 0:
            return None
        return OverlongPenalty(
            self.generation_config.max_new_tokens,
            self.loss_config.overlong_buffer,
            self.loss_config.overlong_penalty,
        )

    # -- loss -------------------------------------------------------------------------------

    def loss_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tokens that carry loss: completion tokens, minus truncated ones if so configured."""
        mask = batch["completion_mask"]
        if self.loss_config.mask_truncated:
            mask = mask * (~batch["truncated"]).unsqueeze(-1).to(mask.dtype)
        return mask

    def freeze_rollout(self, batch: dict[str, torch.Tensor]) -> None:
        """Store the current (rollout-time) policy's and the reference's log-probs in `batch`.

        Called once before the first update of a rollout, so later updates take their ratio
        against the policy that sampled.
        """
        input_ids, attention = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            batch["old_logprobs"] = self.next_token_logprobs(self.policy, input_ids, attention)[0]
        ref = self.reference_logprobs(input_ids, attention)
        if ref is not None:
            batch["ref_logprobs"] = ref

    def compute_loss(
        self,
        batch: dict[str, torch.Tensor],
        num_sequences: float | None = None,
        num_tokens: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch plus detached metrics (kl, clip_fraction, entropy, ...).

        `num_sequences` / `num_tokens`: sizes of the whole optimizer step (see `policy_loss`).
        """
        input_ids, attention = batch["input_ids"], batch["attention_mask"]
        mask = self.loss_mask(batch)
        logprobs, entropy = self.next_token_logprobs(self.policy, input_ids, attention, True)
        has_rollout = batch["has_rollout_logprobs"].unsqueeze(-1)
        # Without frozen rollout log-probs this is the first update: the policy is the sampler.
        # When a separate engine (vLLM) or older weights (in-flight updates) sampled, the
        # sampler's own log-probs feed truncated importance sampling.
        old = batch.get("old_logprobs", logprobs.detach())
        separate = self.generation_config.backend in ("vllm", "vllm_server")
        rollout = (
            torch.where(has_rollout, batch["rollout_logprobs"], old)
            if separate or self.off_policy_samples
            else None
        )
        ref = batch.get("ref_logprobs")
        if ref is None:
            ref = self.reference_logprobs(input_ids, attention)
        loss, metrics = policy_loss(
            logprobs, old, batch["advantages"], mask, self.loss_config,
            ref_logprobs=ref, rollout_logprobs=rollout,
            num_sequences=num_sequences, num_tokens=num_tokens,
        )  # fmt: skip
        with torch.no_grad():
            if rollout is not None:  # trainer–sampler mismatch on the sampled tokens
                sampled = mask * has_rollout
                count = sampled.sum().clamp(min=1)
                metrics["sampler_kl"] = ((rollout - old) * sampled).sum() / count  # k1 estimate
                ratio = torch.exp(old - rollout)[sampled.bool()]
                one = torch.ones((), device=ratio.device)  # the same keys on every rank
                metrics["sampler_ratio_max"] = ratio.max() if ratio.numel() else one
                metrics["sampler_ratio_min"] = ratio.min() if ratio.numel() else one
            assert entropy is not None
            metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
            metrics["tokens"] = mask.sum()
        return loss, metrics

    # -- optimisation -----------------------------------------------------------------------

    def build_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """This agent's own optimizer and schedule."""
        cfg = self.optim_config
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if cfg.optimizer == "adamw8bit":
            import bitsandbytes as bnb

            optimizer: torch.optim.Optimizer = bnb.optim.AdamW8bit(
                params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
            )
        else:
            optimizer = torch.optim.AdamW(
                params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
            )

        def factor(step: int) -> float:
            if cfg.warmup_steps and step < cfg.warmup_steps:
                return (step + 1) / cfg.warmup_steps
            if cfg.schedule == "cosine":
                progress = min(
                    1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
                )
                return 0.5 * (1 + math.cos(math.pi * progress))
            return 1.0

        optimizer.register_step_post_hook(self._optimizer_stepped)  # the generator is now stale
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def training_step(self, dataloader_iter: Any) -> None:
        """Single-agent GRPO: train on this agent's part of a tree-search batch."""
        batch = next_batch(self, dataloader_iter)
        forget_earlier_steps(self)
        samples = batch["agents"].get(self.name, [])
        optimizer = self.optimizers(use_pl_optimizer=False)
        scheduler = self.lr_schedulers()
        if not samples:
            advance_schedule(scheduler)
            return
        metrics = optimise_agent(
            self,
            optimizer,
            scheduler,
            samples,
            self.manual_backward,
            int(batch["counts"][self.name]),
        )
        # One rollout is one Lightning step however many optimizer steps it fed.
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
        self.log_dict({f"{self.name}/{k}": v for k, v in metrics.items()}, batch_size=1)

    def configure_optimizers(self) -> Any:
        optimizer, scheduler = self.build_optimizer()
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def save_pretrained(self, path: str) -> None:
        """Write the policy and tokenizer in Hugging Face format (loadable with Auto* classes)."""
        export_pretrained(self.policy, self.tokenizer, path)


def optimise_agent(
    agent: AgentModule,
    optimizer: Any,
    scheduler: Any,
    batches: list[dict[str, torch.Tensor]],
    backward: Any,
    num_samples: int | None = None,
    sync_gradients: Any = None,
    global_sizes: Any = None,
    pad: Any = None,
) -> dict[str, float]:
    """Update `agent` on one rollout's micro-batches: `ppo_epochs` x `mini_batches` steps, then one
    step of its LR schedule (which counts rollouts).

    Every step's loss is normalised by the size of that whole step (its sequences and tokens over
    all its micro-batches, and over all ranks when `global_sizes` all-reduces [sequences, tokens]),
    so each micro-batch's gradient is its exact share and the step does not depend on the
    micro-batch size. `sync_gradients(agent)` then sums the gradients across ranks. With more than
    one update the rollout-time log-probs are frozen before the first one. `num_samples`, when
    given, must be the number of local samples. `pad(micro_batches, spare=0)` (sharded agents)
    returns the list padded with idle micro-batches to as many as the busiest rank runs (plus
    `spare`), so every rank runs the same forwards and backwards; idle ones count for nothing.
    """
    from mars2.training.batching import split_rows

    cfg = agent.optim_config
    rows = sum(int(b["advantages"].shape[0]) for b in batches)
    if num_samples is not None and num_samples != rows:
        raise ValueError(f"num_samples={num_samples} but the micro-batches hold {rows} samples")
    if cfg.ppo_epochs * cfg.mini_batches > 1:
        # Sharded: every rank freezes as many micro-batches, its idle one included.
        for batch in pad(batches, 1) if pad is not None else batches:
            agent.freeze_rollout(batch)
    parts = split_rows(batches, cfg.mini_batches)
    totals: dict[str, float] = {}
    updates = 0
    for epoch in range(cfg.ppo_epochs):
        for part in parts:
            local = [
                sum(int(b["advantages"].shape[0]) for b in part),
                sum(int(agent.loss_mask(b).sum()) for b in part),
            ]
            sequences, tokens = global_sizes(local) if global_sizes is not None else local
            if sequences == 0:
                continue  # no rank has samples for this part: every rank skips it alike
            optimizer.zero_grad(set_to_none=False)
            step: dict[str, float] = {}
            for batch in pad(part) if pad is not None else part:
                loss, metrics = agent.compute_loss(batch, sequences, tokens)
                backward(loss)
                step["loss"] = step.get("loss", 0.0) + float(loss.detach())
                share = float(metrics.get("tokens", 0.0)) / max(1, local[1])
                for key, value in metrics.items():
                    if key != "tokens":
                        step[key] = step.get(key, 0.0) + float(value) * share
            if sync_gradients is not None:
                sync_gradients(agent)
            if cfg.grad_clip is not None:
                step["grad_norm"] = float(
                    torch.nn.utils.clip_grad_norm_(agent.policy.parameters(), cfg.grad_clip)
                )
            optimizer.step()
            updates += 1
            for key, amount in step.items():
                totals[key] = totals.get(key, 0.0) + amount
            if epoch == 0:
                totals["tokens"] = totals.get("tokens", 0.0) + local[1]
    result = {k: (v if k == "tokens" else v / max(1, updates)) for k, v in totals.items()}
    result["updates"] = float(updates)
    result["lr"] = float(scheduler.get_last_lr()[0])  # what this rollout's updates used
    advance_schedule(scheduler)
    return result


def advance_schedule(scheduler: Any) -> None:
    """One team step along an agent's LR schedule, whether or not its optimizer stepped."""
    with warnings.catch_warnings():  # an agent idle at the first step has not stepped yet: fine
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step\\(\\)` before.*")
        scheduler.step()
