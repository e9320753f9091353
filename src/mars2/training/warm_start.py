"""A short supervised warm start: teach a fresh policy the answer format on known solutions."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mars2.data.problem import Problem
from mars2.generation.prompt import encode_prompt
from mars2.generation.reference import reference_solution
from mars2.search.prompts import PromptBuilder
from mars2.training.agent_module import AgentModule


@dataclass(frozen=True)
class WarmStartConfig:
    """Teacher-forced cross-entropy on the completion tokens only."""

    epochs: int = 30
    lr: float = 2e-3
    batch_size: int = 16
    seed: int = 0
    # Stop early once an epoch's mean loss is at or below this: a level of fit rather than a
    # number of epochs, which lands at very different skill from one seed to the next.
    target_loss: float | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(
                f"epochs and batch_size must be >= 1, got {self.epochs} and {self.batch_size}"
            )
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def answer_text(problem: Problem) -> str:
    """What a good answer looks like: one fenced block with the reference solution."""
    return f"```python\n{reference_solution(problem).strip()}\n```"


def warm_start(agent: AgentModule, problems: Sequence[Problem], config: WarmStartConfig | None = None,
               prompts: PromptBuilder | None = None,
               on_epoch: Callable[[float], None] | None = None,
               stop: Callable[[int, float], bool] | None = None) -> list[float]:  # fmt: skip
    """Fine-tune `agent.policy` in place on (prompt, reference answer) pairs; returns epoch losses.

    `stop(epoch, loss)`, called after each epoch (counted from 1) once the weights are marked
    changed, ends the warm start when it returns True: e.g. a check of the agent's skill on
    problems it does not train on. The agent's weights version moves, and a generator already
    attached serves the new weights and the KL reference (β > 0) becomes the warm-started policy. With LoRA the reference
    is the base with the adapter off, which a warm start of the adapter leaves untrained: refused
    with β > 0.
    """
    if agent.loss_config.beta > 0 and agent.model_spec.lora is not None:
        raise ValueError(
            f"agent {agent.name!r}: a warm start trains the LoRA adapter, but with LoRA the KL "
            "reference is the base with the adapter off, so with loss.beta > 0 the KL would pull "
            "toward the model before the warm start. Set loss.beta=0, warm_start=null, or train "
            "without LoRA (the reference is then a copy of the warm-started policy)."
        )
    config = config or WarmStartConfig()
    prompts = prompts or PromptBuilder()
    tokenizer, policy = agent.tokenizer, agent.policy
    examples = []
    for problem in problems:
        # Encoded directly: building the agent's generator here would start an engine (vLLM)
        # before the weights it should serve are trained.
        prompt_ids = encode_prompt(
            tokenizer, prompts.fresh_messages(problem), agent.generation_config.max_prompt_tokens
        )
        answer_ids = [
            *tokenizer.encode(answer_text(problem), add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
        examples.append((prompt_ids, answer_ids))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=config.lr)
    rng = random.Random(config.seed)
    device = next(policy.parameters()).device
    losses = []
    for epoch in range(1, config.epochs + 1):
        policy.train()  # a stop check may have generated in between
        rng.shuffle(examples)
        total, count = 0.0, 0
        for start in range(0, len(examples), config.batch_size):
            batch = examples[start : start + config.batch_size]
            width = max(len(p) + len(a) for p, a in batch)
            ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (prompt, answer) in enumerate(batch):
                seq = prompt + answer
                ids[row, : len(seq)] = torch.tensor(seq)
                labels[row, len(prompt) : len(seq)] = torch.tensor(answer)
                attention[row, : len(seq)] = 1
            out = policy(
                input_ids=ids.to(device),
                attention_mask=attention.to(device),
                labels=labels.to(device),
            )
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
            total += float(out.loss.detach()) * len(batch)
            count += len(batch)
        losses.append(total / count)
        if on_epoch is not None:  # progress display
            on_epoch(losses[-1])
        if config.target_loss is not None and losses[-1] <= config.target_loss:
            break
        if stop is not None:
            agent.mark_weights_changed()
            if stop(epoch, losses[-1]):
                break
    agent.mark_weights_changed()
    agent.snapshot_reference()
    if agent.has_generator:
        agent.generator.sync()
    return losses
