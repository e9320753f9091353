"""Grade LiveCodeBench-format answers with mars2 (``lcb`` profile) and with LiveCodeBench's own code.

Needs LiveCodeBench's evaluation package importable, as ``lcb_runner`` (a LiveCodeBench checkout on
PYTHONPATH) or ``livecodebench`` (``pip install --no-deps nvidia-livecodebench``; it needs numpy and
tqdm). LiveCodeBench runs answers in plain subprocesses of this one, with no sandbox: use it only on
answers you trust, such as the corpus this defaults to.

    python scripts/lcb_side_by_side.py [--problems P.jsonl] [--candidates C.jsonl] [--workers 2]

Candidates are jsonl rows with ``id``, ``problem`` (a question_id) and ``completion`` (the whole
model answer); an optional ``mars2`` field marks a deliberate difference. Prints every
disagreement and a summary; exits 1 when an undeclared one is found.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from mars2.data.loaders import load_livecodebench
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.verdict.grader import Grader

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "lcb_corpus"


def _lcb_modules() -> tuple[Any, Any, Any]:
    for root in ("lcb_runner", "livecodebench"):
        try:
            metrics = importlib.import_module(f"{root}.evaluation.compute_code_generation_metrics")
            extraction = importlib.import_module(f"{root}.utils.extraction_utils")
            styles = importlib.import_module(f"{root}.lm_styles")
        except ImportError:
            continue
        return metrics, extraction, styles
    sys.exit("LiveCodeBench's code is not importable: see this script's docstring")


def _lcb_passed(results: list[Any]) -> bool:
    return bool(results) and all(r is True or (type(r) is int and r > 0) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default=str(CORPUS / "problems.jsonl"))
    parser.add_argument("--candidates", default=str(CORPUS / "candidates.jsonl"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=6, help="seconds per test, both graders")
    args = parser.parse_args()

    metrics, extraction, styles = _lcb_modules()
    problems = {p.id: p for p in load_livecodebench(args.problems)}
    rows = [json.loads(line) for line in Path(args.candidates).read_text().splitlines() if line]

    samples, generations = [], []
    for row in rows:
        problem = problems[row["problem"]]
        tests = problem.public_tests + problem.private_tests
        io = {"inputs": [t.input for t in tests], "outputs": [t.output for t in tests]}
        io["fn_name"] = problem.fn_name
        samples.append({"input_output": json.dumps(io)})
        generations.append([extraction.extract_code(row["completion"], styles.LMStyle.OpenAIChat)])
    _, lcb_results, _ = metrics.codegen_metrics(
        samples, generations, k_list=[1], num_process_evaluate=args.workers, timeout=args.timeout
    )
    theirs = [_lcb_passed(lcb_results[i][0]) for i in range(len(rows))]

    with LocalSandbox(num_workers=args.workers, per_test_timeout=float(args.timeout)) as box:
        grades = Grader(box, early_stop=True).grade(
            [(problems[r["problem"]], r["completion"]) for r in rows]
        )
    ours = [g.private_passed for g in grades]

    undeclared = 0
    for row, lcb, mine in zip(rows, theirs, ours, strict=True):
        if lcb == mine:
            continue
        declared = "mars2" in row and (row["mars2"] == "pass") == mine
        undeclared += not declared
        tag = "deliberate" if declared else "UNDECLARED"
        print(f"{tag:10s} {row['id']:28s} lcb={'pass' if lcb else 'fail'} "
              f"mars2={'pass' if mine else 'fail'}  {row.get('why', '')}")  # fmt: skip
    agree = sum(a == b for a, b in zip(theirs, ours, strict=True))
    print(f"{agree}/{len(rows)} verdicts agree; {len(rows) - agree - undeclared} deliberate "
          f"differences; {undeclared} undeclared")  # fmt: skip
    if "lcb" in rows[0]:
        wrong = [
            r["id"] for r, lcb in zip(rows, theirs, strict=True) if (r["lcb"] == "pass") != lcb
        ]
        print(f"expected LiveCodeBench verdicts written in the corpus that LiveCodeBench does not "
              f"give: {wrong or 'none'}")  # fmt: skip
    sys.exit(1 if undeclared else 0)


if __name__ == "__main__":
    main()
