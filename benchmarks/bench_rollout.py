"""Rollout drivers compared at one budget: one expansion per tree at a time, rounds, pipelined.

Simulated (the headline): the paper's training shape, 64 trees x 16 nodes, two agents with
long-tailed (lognormal) answer lengths on continuous-batching engines, one decoding 2x slower,
graded by a 32-worker sandbox, all on a virtual clock (`mars2.search.latency`): deterministic and
instant. Both round-synchronous schemes run the unmodified rounds driver, whose blocking
`generate` / `grade` calls advance the clock by the engine's makespan for that batch; the
pipelined driver runs on its virtual runtime with the same models. Targets: pipelined >= 1.5x
the nodes/s of rounds and >= 3x of one-at-a-time, generator busy >= 90%.

Tiny (honest check on real models): the tiny Qwen3 and Llama agents on the transformers backend
(CPU), the local sandbox, wall clock, a short budget.

    python benchmarks/bench_rollout.py [--trees 64 --nodes 16] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.simulation.environment import SimulatedAgent, SimulatedGrader, simulated_problems
from mars2.search.simulation.latency import AnswerLengths, EngineModel, SandboxModel, VirtualClock

REPO = Path(__file__).resolve().parents[1]
SCHEMES = {
    "one per tree (MARTI-style)": {"expansions_per_round": 1},
    "rounds": {},
    "pipelined": {"driver": "pipelined"},
}
# A decoding step of an 8B model at moderate batch on one GPU, answers of a reasoning model.
FAST = EngineModel(token_seconds=0.02, capacity=256, contention=0.5)
SLOW = EngineModel(token_seconds=0.04, capacity=256, contention=0.5)
LENGTHS = AnswerLengths(median=1500, sigma=0.7, max_tokens=8192)
SANDBOX = SandboxModel(workers=32, per_test_seconds=0.05, overhead_seconds=1.0)


def _simulated_team(skills: dict[str, float], clock: VirtualClock | None) -> dict[str, Any]:
    # The slower agent is the stronger one, as a bigger model would be.
    return {
        "fast": SimulatedAgent(lambda p: 0.6 * skills[p], refine_boost=0.05, seed=11,
                               lengths=LENGTHS, latency=FAST, clock=clock, name="fast"),
        "slow": SimulatedAgent(lambda p: skills[p], refine_boost=0.05, seed=12, lengths=LENGTHS,
                               latency=SLOW, clock=clock, name="slow"),
    }  # fmt: skip


def run_simulated(trees: int, nodes: int, width: int, seed: int) -> dict[str, dict[str, Any]]:
    problems = simulated_problems(trees)
    rng = np.random.default_rng(seed)
    skills = {p.id: float(rng.beta(1, 20)) for p in problems}
    results: dict[str, dict[str, Any]] = {}
    for scheme, overrides in SCHEMES.items():
        config = SearchConfig(
            max_nodes=nodes, **{"expansions_per_round": width, "clock": "virtual", **overrides}
        )
        pipelined = config.driver == "pipelined"
        clock = None if pipelined else VirtualClock()
        search = TreeSearch(config)
        began = time.perf_counter()
        grown = search.grow(
            problems,
            _simulated_team(skills, clock),
            SimulatedGrader(latency=SANDBOX, clock=clock),
            np.random.default_rng(seed),
        )
        real = time.perf_counter() - began
        span = search.timings.span if clock is None else clock.now
        busy = search.timings.busy if clock is None else clock.busy
        results[scheme] = _row(grown, span, busy, real)
    return results


def _row(grown: list, span: float, busy: dict[str, float], real: float) -> dict[str, Any]:
    count = sum(len(t) for t in grown)
    agents = [k for k in busy if k != "sandbox"]
    return {
        "nodes": count,
        "span_s": span,
        "nodes_per_s": count / span,
        "busy": {k: busy.get(k, 0.0) / span for k in [*agents, "sandbox"]},
        "generator_busy": float(np.mean([busy[a] / span for a in agents])),
        "solve_rate": float(np.mean([t.solved for t in grown])),
        "real_s": real,
    }


def run_tiny(trees: int, nodes: int, width: int, seed: int) -> dict[str, dict[str, Any]]:
    """The three schemes on the tiny transformers agents and the local sandbox (wall clock)."""
    from hydra import compose, initialize_config_dir

    from mars2.models.tiny import make_tiny_models
    from mars2.training.run import build_run

    tiny = Path(os.environ.get("MARS2_TINY_MODELS", REPO / ".cache" / "tiny_models"))
    make_tiny_models(tiny)
    with (
        tempfile.TemporaryDirectory() as out,
        initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"),
    ):
        cfg = compose(config_name="train", overrides=[
            "experiment=tiny_pair", "warm_start=null", f"paths.tiny_models_dir={tiny}",
            f"paths.output_dir={out}", f"paths.log_dir={out}/logs", "logger=none",
        ])  # fmt: skip
        module, datamodule, _, sandbox = build_run(cfg)
        try:
            generators = {name: agent.generator for name, agent in module.agents.items()}
            grader = datamodule.engine.grader
            problems = datamodule.engine.schedule.problems[:trees]
            import torch

            # One intra-op thread each: on a shared 2-core machine, OpenMP teams spinning against
            # each other would time the thread pool, not the drivers.
            torch.set_num_threads(1)
            for generator in generators.values():  # first-call costs out of every timed run
                generator.generate([[{"role": "user", "content": problems[0].statement}]])
            results: dict[str, dict[str, Any]] = {}
            for scheme, overrides in SCHEMES.items():
                config = SearchConfig(
                    max_nodes=nodes, **{"expansions_per_round": width, **overrides}
                )
                search = TreeSearch(config)
                torch.manual_seed(seed)
                began = time.perf_counter()
                grown = search.grow(problems, generators, grader, np.random.default_rng(seed))
                real = time.perf_counter() - began
                results[scheme] = _row(grown, search.timings.span, search.timings.busy, real)
        finally:
            sandbox.close()
    return results


def print_table(title: str, results: dict[str, dict[str, Any]], unit: str) -> None:
    print(title)
    print(f"  {'scheme':28} {'nodes':>6} {unit:>10} {'nodes/s':>8} {'gen busy':>8} "
          f"{'per agent':>22} {'sandbox':>8} {'solved':>7}")  # fmt: skip
    for scheme, row in results.items():
        agents = " ".join(f"{k}={v:.0%}" for k, v in row["busy"].items() if k != "sandbox")
        print(f"  {scheme:28} {row['nodes']:6d} {row['span_s']:10.1f} {row['nodes_per_s']:8.3f} "
              f"{row['generator_busy']:8.1%} {agents:>22} {row['busy']['sandbox']:8.1%} "
              f"{row['solve_rate']:7.3f}")  # fmt: skip
    piped = results["pipelined"]["nodes_per_s"]
    print(f"  pipelined / rounds nodes/s: {piped / results['rounds']['nodes_per_s']:.2f}x; "
          f"pipelined / one per tree: {piped / results['one per tree (MARTI-style)']['nodes_per_s']:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trees", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--width", type=int, default=4, help="expansions per round / in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="also run the tiny transformers agents")
    args = parser.parse_args()
    simulated = run_simulated(args.trees, args.nodes, args.width, args.seed)
    print_table(
        f"simulated latency, {args.trees} trees x {args.nodes} nodes, two agents (one 2x slower), "
        "virtual clock (targets: pipelined >= 1.5x rounds, >= 3x one per tree, busy >= 90%)",
        simulated,
        "virtual s",
    )
    if args.tiny:
        print_table(
            "tiny agents, transformers backend on CPU, local sandbox, wall clock, 8 trees x 6 nodes",
            run_tiny(8, 6, 3, args.seed),
            "wall s",
        )


if __name__ == "__main__":
    main()
