"""One GRPO step on the same tiny model and batch: ours vs TRL's GRPOTrainer (same run, same machine).

A step = sample G completions for each of P prompts, score them with the same reward function,
compute group advantages, one optimizer step on the clipped-ratio loss. Both sides use the same
tiny Qwen3 agent, prompts, G, completion length, temperature, learning rate and beta = 0. The
median over the timed steps is reported (the first step of each is a warm-up).
Target: ours <= 0.8x TRL's time.

    python benchmarks/bench_grpo_step.py --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mars2.data.toy import toy_problems
from mars2.generation.factory import build_generators
from mars2.models.loading import ModelSpec
from mars2.models.tiny import make_tiny_models
from mars2.rewards.routing import Sample
from mars2.search.prompts import PromptBuilder
from mars2.search.tree import Node
from mars2.training.agent_module import AgentModule, GenerationConfig, OptimConfig, optimise_agent
from mars2.training.batching import micro_batches
from mars2.training.losses import LossConfig

REPO = Path(__file__).resolve().parents[1]


def reward(text: str) -> float:
    """Cheap and deterministic, the same for both: share of characters that are digits or spaces."""
    return sum(c.isdigit() or c == " " for c in text) / max(1, len(text))


def chats(prompts: int) -> list[list[dict[str, str]]]:
    builder = PromptBuilder()
    return [builder.fresh_messages(p) for p in toy_problems()[:prompts]]


def ours(model_dir: Path, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    agent = AgentModule(
        "tiny_qwen3",
        ModelSpec(str(model_dir)),
        GenerationConfig(
            max_new_tokens=args.tokens, temperature=1.0, batch_size=args.prompts * args.group
        ),
        OptimConfig(lr=1e-5, grad_clip=1.0),
        LossConfig(variant="grpo", beta=0.0, eps_low=0.2, eps_high=0.2),
        micro_batch_size=args.prompts * args.group,
    )
    optimizer, scheduler = agent.build_optimizer()
    batch_chats = [c for c in chats(args.prompts) for _ in range(args.group)]
    generator = build_generators({"tiny_qwen3": agent})["tiny_qwen3"]
    times = []
    for _ in range(args.steps + 1):
        began = time.perf_counter()
        generator.catch_up()  # serve the weights of the last step
        completions = generator.generate(batch_chats)
        rewards = np.array([reward(c.text) for c in completions]).reshape(args.prompts, args.group)
        advantages = (rewards - rewards.mean(1, keepdims=True)) / (
            rewards.std(1, keepdims=True) + 1e-4
        )
        samples = [
            Sample(Node(i, 0, 1, "tiny_qwen3", completion=c), i // args.group, 0.0,
                   float(advantages.flat[i]))
            for i, c in enumerate(completions)
        ]  # fmt: skip
        batches = micro_batches(samples, agent.micro_batch_size, agent.tokenizer.pad_token_id)
        optimise_agent(
            agent, optimizer, scheduler, batches, lambda loss: loss.backward(), len(samples)
        )
        times.append(time.perf_counter() - began)
    return times[1:]


def trl(model_dir: Path, args: argparse.Namespace) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    dataset = Dataset.from_list([{"prompt": c} for c in chats(args.prompts)] * (args.steps + 2))

    def reward_fn(completions: list, **_: object) -> list[float]:
        return [reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: object, **k: object) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            times.append(time.perf_counter() - self.began)

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
            max_completion_length=args.tokens, temperature=1.0, top_k=0, learning_rate=1e-5, beta=0.0,
            max_steps=args.steps + 1, logging_steps=1000, report_to="none", use_cpu=True, save_strategy="no",
            shuffle_dataset=False, seed=0, dataloader_num_workers=0, max_grad_norm=1.0, loss_type="grpo",
            gradient_checkpointing=False,  # ours does not recompute activations either
        )  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Timer()])  # fmt: skip
        trainer.train()
    return times[1:]


def run(args: argparse.Namespace) -> dict[str, float]:
    tiny = Path(os.environ.get("MARS2_TINY_MODELS", REPO / ".cache" / "tiny_models"))
    model_dir = make_tiny_models(tiny)["tiny_qwen3"]
    ours_s = statistics.median(ours(model_dir, args))
    trl_s = statistics.median(trl(model_dir, args))
    return {"ours_s": ours_s, "trl_s": trl_s, "ratio": ours_s / trl_s}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    result = run(args)
    print(
        f"GRPO step, tiny Qwen3, {args.prompts} prompts x {args.group} completions x {args.tokens} tokens"
    )
    print(f"  mars2   {result['ours_s']:.3f} s/step")
    print(f"  TRL     {result['trl_s']:.3f} s/step")
    print(f"  ratio ours/TRL {result['ratio']:.2f} (target <= 0.8)")


if __name__ == "__main__":
    main()
