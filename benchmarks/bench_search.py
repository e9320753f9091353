"""Our search vs TreeQuest's multi-LLM ABMCTSA on the same simulated problems and budget.

Two agents of different strength share each tree. Each of our strategies runs against the
TreeQuest strategy it follows (stack -> ABMCTSA stack, bandit -> multiarm_bandit_thompson; flat
against stack), both with Beta posteriors and one expansion at a time. Prints solve rate and the
wall time of the search bookkeeping (everything but generating and grading, which both sides get
from the simulator), with the ratios (targets: solve rate >= TreeQuest's, bookkeeping >= 10x
faster).

    python benchmarks/bench_search.py --problems 200 --budget 16 --seeds 3 --strategies stack bandit flat
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from mars2.search.policy import PolicyConfig
from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.simulation.environment import SimulatedAgent, SimulatedGrader, simulated_problems


def _team(skills: dict[str, float], seed: int) -> dict[str, SimulatedAgent]:
    return {
        "strong": SimulatedAgent(lambda pid: skills[pid], seed=seed),
        "weak": SimulatedAgent(lambda pid: 0.3 * skills[pid], seed=seed + 1),
    }


TREEQUEST_STRATEGY = {"stack": "stack", "bandit": "multiarm_bandit_thompson", "flat": "stack"}


def run_ours(
    problems: list, skills: dict[str, float], budget: int, seed: int, strategy: str = "stack"
) -> dict[str, float]:
    policy = PolicyConfig(strategy=strategy)  # type: ignore[arg-type]
    search = TreeSearch(SearchConfig(max_nodes=budget, expansions_per_round=1, policy=policy))
    began = time.perf_counter()
    trees = search.grow(
        problems, _team(skills, seed), SimulatedGrader(), np.random.default_rng(seed)
    )
    total = time.perf_counter() - began
    return {
        "solve_rate": sum(t.solved for t in trees) / len(trees),
        "bookkeeping_s": search.timings.bookkeeping,
        "total_s": total,
    }


def run_treequest(
    problems: list, skills: dict[str, float], budget: int, seed: int, strategy: str = "stack"
) -> dict[str, float]:
    import treequest as tq

    team = _team(skills, seed)
    grader = SimulatedGrader()
    outside = 0.0  # time spent in the simulator (generate + grade), not in TreeQuest

    def make_fn(agent: SimulatedAgent, problem: Any):
        def generate(parent: dict | None) -> tuple[dict, float]:
            nonlocal outside
            began = time.perf_counter()
            statement = problem.statement + ("\nA previous attempt" if parent is not None else "")
            (completion,) = agent.generate([[{"role": "user", "content": statement}]])
            (grade,) = grader.grade([(problem, completion.text)])
            outside += time.perf_counter() - began
            return {"passed": grade.private_passed}, grade.reward

        return generate

    solved = 0
    began = time.perf_counter()
    for problem in problems:
        algo = tq.ABMCTSA(dist_type="beta", model_selection_strategy=strategy)
        state = algo.init_tree()
        fns = {name: make_fn(agent, problem) for name, agent in team.items()}
        for _ in range(budget):
            state = algo.step(state, fns, inplace=True)
        solved += any(s["passed"] for s, _ in algo.get_state_score_pairs(state))
    total = time.perf_counter() - began
    return {
        "solve_rate": solved / len(problems),
        "bookkeeping_s": total - outside,
        "total_s": total,
    }


def run(
    problems: int, budget: int, seed: int, strategies: list[str], seeds: int = 1
) -> dict[str, dict[str, float]]:
    """Pooled over `seeds` independent problem sets (seed, seed + 1, ...): solve rate is the mean,
    times are sums."""
    result: dict[str, dict[str, float]] = {}

    def add(name: str, row: dict[str, float]) -> None:
        total = result.setdefault(name, {"solve_rate": 0.0, "bookkeeping_s": 0.0, "total_s": 0.0})
        total["solve_rate"] += row["solve_rate"] / seeds
        total["bookkeeping_s"] += row["bookkeeping_s"]
        total["total_s"] += row["total_s"]

    for offset in range(seeds):
        current = seed + offset
        items = simulated_problems(problems, prefix=f"sim{current}")
        rng = np.random.default_rng(current)
        skills = {p.id: float(rng.beta(1, 20)) for p in items}
        np.random.seed(current)  # TreeQuest samples through numpy's global generator
        peers_done = set()
        for name in strategies:
            add(f"mars2 {name}", run_ours(items, skills, budget, current, name))
            peer = TREEQUEST_STRATEGY[name]
            if peer not in peers_done:
                peers_done.add(peer)
                add(f"treequest {peer}", run_treequest(items, skills, budget, current, peer))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3, help="problem sets to pool")
    parser.add_argument(
        "--strategies", nargs="+", default=["stack"], choices=sorted(TREEQUEST_STRATEGY)
    )
    args = parser.parse_args()
    result = run(args.problems, args.budget, args.seed, args.strategies, args.seeds)
    print(
        f"{args.seeds} x {args.problems} simulated problems, {args.budget} nodes per tree, "
        "strong + weak agent"
    )
    print(f"  {'':28} {'solve rate':>10} {'bookkeeping s':>14}")
    for name, row in result.items():
        print(f"  {name:28} {row['solve_rate']:10.3f} {row['bookkeeping_s']:14.4f}")
    for name in args.strategies:
        ours, theirs = result[f"mars2 {name}"], result[f"treequest {TREEQUEST_STRATEGY[name]}"]
        peer = TREEQUEST_STRATEGY[name]
        print(
            f"  {name} vs TreeQuest {peer}: solve rate ratio "
            f"{ours['solve_rate'] / max(theirs['solve_rate'], 1e-9):.2f} (target >= 1.0), "
            f"bookkeeping speedup {theirs['bookkeeping_s'] / ours['bookkeeping_s']:.1f}x "
            "(target >= 10x)"
        )


if __name__ == "__main__":
    main()
