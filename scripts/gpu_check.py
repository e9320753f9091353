"""The verdicts of `scripts/gpu_check.sh`: each prints ONE line (PASS/FAIL and numbers) and
exits 0 on PASS, 1 on FAIL.

python scripts/gpu_check.py train FIRST_RUN RESUMED_RUN [--device gpu]  # reward > 0, exact resume
python scripts/gpu_check.py eval EVAL_DIR                # it loaded ckpt_path and solved something
python scripts/gpu_check.py calibration calibration.json # every case measured and within 15%
python scripts/gpu_check.py terms terms.json             # issue #43's terms: measured vs planned
(`rewards RUN` and `resume FIRST RESUMED` are the two halves of `train`.)
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

# Logged values that measure time (they differ between two runs of the same steps).
TIMING = re.compile(r"seconds|busy|idle|per_second")
TOLERANCE = 0.15  # the bar for the memory estimate


def metric_rows(run: Path) -> dict[int, dict[str, str]]:
    """The CSV logger's rows of a run folder by step (a step logged twice keeps its first row)."""
    files = sorted(run.glob("csv/*/metrics.csv"))
    if not files:
        raise FileNotFoundError(f"no csv/*/metrics.csv under {run} (logger=csv?)")
    rows: dict[int, dict[str, str]] = {}
    for path in files:
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                if row.get("step"):
                    rows.setdefault(int(float(row["step"])), row)
    return rows


def rewards(run: Path) -> tuple[bool, str]:
    steps = metric_rows(run)
    values = {s: float(r["reward"]) for s, r in sorted(steps.items()) if r.get("reward")}
    listed = ", ".join(f"{s}: {v:.3f}" for s, v in values.items())
    ok = bool(values) and max(values.values()) > 0
    return ok, f"rewards per step {{{listed}}}" + ("" if ok else ": no reward > 0")


def _weights(run: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(run.glob("agents/*/*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no agents/*/*.safetensors under {run}")
    return {f"{p.parent.name}/{k}": v for p in files for k, v in load_file(p).items()}


def resume(first: Path, resumed: Path) -> tuple[bool, str]:
    """The resumed run's steps against the same steps of the uninterrupted run: every logged value
    but timings equal, and the final weights bit for bit."""
    import torch

    original, again = metric_rows(first), metric_rows(resumed)
    steps = sorted(again)
    problems = []
    if not steps:
        problems.append("the resumed run logged no step")
    for step in steps:
        if step not in original:
            problems.append(f"step {step} missing from the first run")
            continue
        for key, value in again[step].items():
            if TIMING.search(key) or value == "" or original[step].get(key, "") == "":
                continue
            if float(value) != float(original[step][key]):
                problems.append(f"step {step} {key}: {original[step][key]} != {value}")
    a, b = _weights(first), _weights(resumed)
    if a.keys() != b.keys():
        problems.append(f"different weight names: {sorted(a.keys() ^ b.keys())[:4]}")
    unequal = [k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])]
    worst = max((float((a[k].float() - b[k].float()).abs().max()) for k in unequal), default=0.0)
    if unequal:
        problems.append(
            f"{len(unequal)} of {len(a)} weight tensors differ (max |diff| {worst:.3g})"
        )
    compared = f"steps {steps} compared, {len(a)} weight tensors"
    if problems:
        return False, f"{compared}; " + "; ".join(problems[:6])
    return True, f"{compared}: every logged value and every weight identical"


def train(first: Path, resumed: Path, device: str = "gpu") -> tuple[bool, str]:
    """Both runs on the expected device with reward > 0, and the resumed steps exact."""
    problems = []
    for run in (first, resumed):
        log = "".join(p.read_text(errors="replace") for p in run.glob("*.log"))
        on_gpu = re.search(r"GPU available: True.*used: True", log) is not None
        if on_gpu != (device == "gpu"):
            problems.append(f"{run.name} did not train on the {device}")
    ok_first, first_rewards = rewards(first)
    ok_resumed, _ = rewards(resumed)
    if not (ok_first and ok_resumed):
        problems.append("no reward > 0 in " + " and ".join(
            r.name for r, ok in ((first, ok_first), (resumed, ok_resumed)) if not ok
        ))  # fmt: skip
    exact, compared = resume(first, resumed)
    detail = f"on the {device}, {first_rewards}; resume: {compared}"
    if not exact:
        problems.append("the resumed run differs")
    return not problems, detail + "".join(f"; {p}" for p in problems)


def evaluation(out: Path) -> tuple[bool, str]:
    """An eval run folder: it loaded `ckpt_path` (its log says so) and solved something."""
    results = json.loads((out / "results.json").read_text())
    results = results["settings"] if isinstance(results, dict) else results
    scores = {}
    for setting in results:  # agents alone report pass@1, tree settings pass@1(mcts)
        metrics = setting["metrics"]
        scores[setting["name"]] = float(metrics.get("pass@1", metrics.get("pass@1(mcts)", 0.0)))
    listed = ", ".join(f"{name} {value:.3f}" for name, value in scores.items())
    logs = "".join(p.read_text(errors="replace") for p in out.glob("*.log"))
    problems = []
    if "loaded trained agents from" not in logs:
        problems.append("its log does not say it loaded ckpt_path")
    if not scores or max(scores.values()) <= 0:
        problems.append("the checkpoint solved nothing")
    detail = f"pass@1 / pass@1(mcts) {{{listed}}}"
    return not problems, detail + "".join(f"; {p}" for p in problems)


def calibration(path: Path, cpu: bool = False) -> tuple[bool, str]:
    """Every case measured (or out of memory where the estimate said it would not fit) and the
    device's peak within 15% of the estimate. `cpu`: a CPU rehearsal, where only the tensors'
    bytes are measured; they are held to the same 15% of the estimate's resident terms."""
    report = json.loads(path.read_text())
    off, unmeasured, within = [], [], 0
    key = "tensors/resident" if cpu else "device/estimate"
    for case in report["cases"]:
        ratio = (case.get("ratios") or {}).get(key)
        if ratio is None and case["status"] == "measured":
            unmeasured.append(f"{case['case']} (no GPU peak: measured on CPU)")
        elif ratio is None:
            expected_oom = case["status"].startswith("out of memory") and not case.get(
                "predicted", {}
            ).get("fits", True)
            if not (expected_oom or case["status"].startswith("skipped")):
                unmeasured.append(f"{case['case']} ({case['status'][:60]})")
        elif abs(ratio - 1) > TOLERANCE:
            off.append(f"{case['case']} {ratio:.2f}")
        else:
            within += 1
    gpu = report["environment"].get("gpu", "the CPU")
    summary = f"{within} of {len(report['cases'])} cases within {TOLERANCE:.0%} ({key}) on {gpu}"
    if off:
        summary += "; measured/estimated off: " + ", ".join(off)
    if unmeasured:
        summary += "; not measured: " + ", ".join(unmeasured)
    if cpu:
        summary += (
            "; GPU only, not measured here: activations, logits, the CUDA context and the "
            "device's peak (device/estimate)"
        )
    return not off and not unmeasured and within > 0, summary


def terms(path: Path) -> tuple[bool, str]:
    """scripts/gpu_terms.py's report: each term's measured value next to the plan's; FAIL when a
    term measured is off (ok false) or broke; terms not measurable there (ok null) are listed."""
    report = json.loads(path.read_text())
    parts, off = [], []
    for record in report["terms"]:
        state = {True: "ok", False: "OFF", None: "not measured"}[record["ok"]]
        parts.append(
            f"{record['term']} measured {record['measured']} vs planned {record['planned']} "
            f"{record['unit']} ({state})"
        )
        if record["ok"] is False:
            off.append(f"{record['term']}: {record['note']}")
    summary = f"on {report.get('gpu', 'the CPU')}: " + "; ".join(parts)
    if off:
        summary += " | off: " + "; ".join(off)
    return not off and bool(parts), summary


CHECKS = {
    "train": train,
    "rewards": rewards,
    "resume": resume,
    "eval": evaluation,
    "calibration": calibration,
    "terms": terms,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--label", help="the step's name on the result line (default: the check)")
    parser.add_argument(
        "--device", choices=("gpu", "cpu"), default="gpu", help="train: where it ran"
    )
    parser.add_argument("--cpu", action="store_true", help="calibration: a CPU rehearsal")
    args = parser.parse_args(argv)
    label = args.label or args.check
    options: dict[str, Any] = {}
    if args.check == "train":
        options["device"] = args.device
    if args.check == "calibration":
        options["cpu"] = args.cpu
    try:
        ok, detail = CHECKS[args.check](*args.paths, **options)
    except (OSError, ValueError, KeyError, TypeError) as err:
        ok, detail = False, f"{type(err).__name__}: {err}"
    print(f"{'PASS' if ok else 'FAIL'} {label}: {detail}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
