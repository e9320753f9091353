"""Learning demo (CPU, offline): vanilla GRPO vs single-agent tree search vs MARS² with two agents.

Both tiny agents first get the same short supervised warm start on a disjoint set of solved
problems, so that they emit runnable code. Then each method trains from those weights on the same
problems with the same number of generated completions per step, and the held-out solve rate
(pass@1) is measured every few steps. With ``--seeds N`` the whole experiment (warm start
included) is repeated for seeds seed..seed+N-1 and the table and plot show mean ± sd over seeds.
Each agent's warm start runs until its training loss reaches a target (a fixed number of epochs
lands at very different skill from one seed to the next); the weaker agent (tiny_llama) stops at a
higher loss (``--weak-warm-loss``) so that it starts weaker but still a real team member. Writes a
PNG and a JSON of the curves and prints the table.

    python scripts/learning_curve.py --steps 40 --seeds 3 --out logs/learning_curve
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from mars2.data.sources import arithmetic
from mars2.eval.callbacks import HeldOutEvalCallback
from mars2.models.loading import ModelSpec
from mars2.models.tiny import make_tiny_models
from mars2.training.agent_module import AgentModule, GenerationConfig
from mars2.training.run import build_run
from mars2.training.warm_start import WarmStartConfig, warm_start

REPO = Path(__file__).resolve().parents[1]
METHODS = {
    "vanilla GRPO (tiny_qwen3)": ["experiment=tiny_grpo", "agent=[tiny_qwen3]"],
    "single-agent tree (tiny_qwen3)": ["experiment=tiny_pair", "agent=[tiny_qwen3]"],
    "MARS2 pair (tiny_qwen3 + tiny_llama)": [
        "experiment=tiny_pair",
        "agent=[tiny_qwen3,tiny_llama]",
    ],
}


def warm_started(
    base: Path, out: Path, targets: dict[str, float], max_epochs: int, seed: int
) -> Path:
    """Warm-start both tiny agents once per seed, each to its target loss; every method starts
    from these weights."""
    target = out / f"warm_seed{seed}"
    problems = arithmetic("warm_start")
    for name in ("tiny_qwen3", "tiny_llama"):
        if (target / name / "config.json").exists():
            continue
        agent = AgentModule(name, ModelSpec(str(base / name)), GenerationConfig(max_new_tokens=24))
        config = WarmStartConfig(epochs=max_epochs, seed=seed, target_loss=targets[name])
        losses = warm_start(agent, problems, config)
        agent.save_pretrained(str(target / name))
        print(
            f"warm start {name} (seed {seed}): loss {losses[0]:.3f} -> {losses[-1]:.3f} in "
            f"{len(losses)} epochs on {len(problems)} problems"
        )
    return target


def run_method(
    name: str, overrides: list[str], models: Path, out: Path, args: argparse.Namespace
) -> list[tuple[int, str, float]]:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                *overrides,
                "data=arith",
                "warm_start=null",  # done once above, so every method starts from the same weights
                f"paths.tiny_models_dir={models}",
                f"paths.output_dir={out / f'{name.split()[0].lower()}_seed{args.seed}'}",
                f"paths.log_dir={out}/logs",
                "logger=csv",
                "callbacks.checkpoint=null",
                "~callbacks.progress",
                "+trainer.enable_progress_bar=false",
                f"steps={args.steps}",
                f"problems_per_step={args.problems_per_step}",
                f"search.config.max_nodes={args.nodes}",
                f"seed={args.seed}",
                *(f"agents.{a}.{key}" for a in ("tiny_qwen3", "tiny_llama") if a in " ".join(overrides)
                  for key in ("generation.max_new_tokens=24", f"generation.temperature={args.temperature}",
                              f"optim.lr={args.lr}", "loss.max_tokens=24")),
            ],
        )  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    heldout = HeldOutEvalCallback(
        arithmetic("held_out"), every=args.eval_every, samples=args.eval_samples
    )
    trainer.callbacks.append(heldout)
    began = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    print(f"{name}: {args.steps} steps in {time.perf_counter() - began:.0f}s")
    return heldout.history


def _by_step(history: list[tuple[int, str, float]]) -> dict[int, float]:
    """Mean over the method's agents at each evaluated step."""
    steps = sorted({s for s, _, _ in history})
    return {s: float(np.mean([v for s2, _, v in history if s2 == s])) for s in steps}


def summarise(
    runs: dict[str, list[list[tuple[int, str, float]]]],
) -> dict[str, dict[int, tuple[float, float]]]:
    """Per method and step: (mean, sd) over seeds of the mean held-out pass@1 of its agents."""
    table: dict[str, dict[int, tuple[float, float]]] = {}
    for method, histories in runs.items():
        per_seed = [_by_step(h) for h in histories]
        steps = sorted(set.intersection(*(set(p) for p in per_seed)))
        table[method] = {
            s: (float(np.mean([p[s] for p in per_seed])), float(np.std([p[s] for p in per_seed])))
            for s in steps
        }
    return table


def plot(table: dict[str, dict[int, tuple[float, float]]], seeds: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method, rows in table.items():
        steps = sorted(rows)
        mean = np.array([rows[s][0] for s in steps])
        sd = np.array([rows[s][1] for s in steps])
        ax.plot(steps, mean, marker="o", label=method)
        ax.fill_between(steps, mean - sd, mean + sd, alpha=0.15)
    ax.set(
        xlabel="training step",
        ylabel="held-out pass@1",
        title=f"Tiny agents on held-out arithmetic programs (mean ± sd over {seeds} seeds)",
        ylim=(0, 1),
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "logs" / "learning_curve")
    parser.add_argument("--tiny", type=Path, default=REPO / ".cache" / "tiny_models")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--problems-per-step", type=int, default=4)
    parser.add_argument(
        "--nodes", type=int, default=8, help="completions per problem per step, every method"
    )
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--warm-max-epochs", type=int, default=150)
    parser.add_argument(
        "--warm-loss", type=float, default=0.05, help="tiny_qwen3's warm start stops at this loss"
    )
    parser.add_argument(
        "--weak-warm-loss",
        type=float,
        default=0.09,
        help="tiny_llama's (the weaker agent's) warm start stops at this loss",
    )
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3, help="repeat for seed..seed+N-1")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_tiny_models(args.tiny)
    targets = {"tiny_qwen3": args.warm_loss, "tiny_llama": args.weak_warm_loss}
    runs: dict[str, list[list[tuple[int, str, float]]]] = {name: [] for name in METHODS}
    first = args.seed
    for seed in range(first, first + args.seeds):
        args.seed = seed
        models = warm_started(args.tiny, args.out, targets, args.warm_max_epochs, seed)
        # The pair first: its step-0 evaluation shows early whether the weak agent is a member.
        for name in sorted(METHODS, key=lambda method: "pair" not in method):
            runs[name].append(run_method(name, METHODS[name], models, args.out, args))
    (args.out / "learning_curve.json").write_text(json.dumps(runs, indent=1))
    table = summarise(runs)
    plot(table, args.seeds, args.out / "learning_curve.png")
    steps = sorted({s for rows in table.values() for s in rows})
    print(f"\nheld-out pass@1 (mean over the method's agents; mean ± sd over {args.seeds} seeds)")
    print("| step | " + " | ".join(table) + " |")
    print("| --- |" + " --- |" * len(table))
    for step in steps:
        cells = [
            f"{rows[step][0]:.3f} ± {rows[step][1]:.3f}" if step in rows else ""
            for rows in table.values()
        ]
        print(f"| {step} | " + " | ".join(cells) + " |")
    for name, histories in runs.items():
        agents = sorted({a for h in histories for _, a, _ in h})
        if len(agents) > 1:
            for agent in agents:
                start = [v for h in histories for s, a, v in h if a == agent and s == 0]
                if start:
                    print(f"{name}: {agent} at step 0: {np.mean(start):.3f} ± {np.std(start):.3f}")
    print(f"\nwrote {args.out / 'learning_curve.png'}")


if __name__ == "__main__":
    main()
