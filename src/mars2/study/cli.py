"""``mars2-study``: run a pre-registered study, analyse its raw runs, write its report.

    mars2-study run configs/study/team_vs_alone.yaml --jobs 2
    mars2-study analyse configs/study/team_vs_alone.yaml        # summary.json from runs.jsonl
    mars2-study report configs/study/team_vs_alone.yaml         # analyse + report.md + plot
    mars2-study run <study> --seeds 7 8 9 --out DIR             # same study, other seeds

Default ``--out``: ``docs/study/<name>/``; weights and the job cache go to ``--work`` (default
``.cache/study/<name>``; rerunning resumes from it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from mars2.study.analysis import analyse, load_runs, write_summary
from mars2.study.report import plot, report_markdown
from mars2.study.runner import REPO, run_study
from mars2.study.spec import Study, StudyError, load_study


def _paths(study: Study, args: argparse.Namespace) -> tuple[Path, Path]:
    out = Path(args.out) if args.out else REPO / "docs" / "study" / study.name
    work = Path(args.work) if args.work else REPO / ".cache" / "study" / study.name
    if args.seeds and not args.out:  # other seeds never overwrite the study's own evidence
        out = out / ("seeds_" + "_".join(map(str, args.seeds)))
    return out, work


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mars2-study",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=("run", "analyse", "report"))
    parser.add_argument("study", help="the study file, configs/study/<name>.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", help="instead of the study file's seeds")
    parser.add_argument("--out", help="where runs.jsonl, summary.json, report.md go")
    parser.add_argument("--work", help="weights and job cache (resume from here)")
    parser.add_argument("--jobs", type=int, default=2, help="jobs at a time (one core each)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--collect", action="store_true",
                        help="run: write runs.jsonl from the finished (cached) jobs, run nothing")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        study = load_study(args.study)
    except StudyError as error:
        parser.exit(2, f"mars2-study: {error}\n")
    out, work = _paths(study, args)
    seeds = args.seeds or study.seeds
    if args.command == "run":
        began = time.perf_counter()
        records = run_study(study, seeds, out, work, args.jobs, progress=not args.no_progress,
                            collect_only=args.collect)  # fmt: skip
        shutil.copyfile(study.path, out / "study.yaml")
        failed = [r["id"] for r in records if r["error"] is not None]
        wall = time.perf_counter() - began
        print(f"{len(records)} jobs ({len(failed)} failed) in {wall:.0f}s wall; wrote "
              f"{out / 'runs.jsonl'}", flush=True)  # fmt: skip
        return
    runs = load_runs(out / "runs.jsonl")
    if args.seeds:
        runs = [r for r in runs if int(r["seed"]) in set(args.seeds)]
    summary = analyse(study, runs)
    write_summary(summary, out / "summary.json")
    if args.command == "report":
        (out / "report.md").write_text(report_markdown(summary, study.raw))
        plot(summary, out / "study.png")
    for c in summary["comparisons"]:
        if c["family"] == "primary":
            print(json.dumps({k: c.get(k) for k in ("id", "mean", "ci", "sign_flip_p", "holm_p",
                                                     "verdict")}))  # fmt: skip
    print(f"wrote {out / 'summary.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()


def legacy_arguments(argv: list[str]) -> list[str]:
    """``scripts/learning_curve.py``'s old options (``--seeds N`` from ``--seed S``, ``--out``,
    ``--jobs``) as ``mars2-study run`` options on the team_vs_alone study."""
    parser = argparse.ArgumentParser(prog="learning_curve.py", description=LEGACY)
    parser.add_argument("--seed", type=int, default=None, help="first seed (default: the study's)")
    parser.add_argument("--seeds", type=int, default=None, help="how many seeds from --seed")
    parser.add_argument("--out", default=str(REPO / "logs" / "learning_curve"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--study", default=str(REPO / "configs" / "study" / "team_vs_alone.yaml"))
    args = parser.parse_args(argv)
    out = [args.study, "--out", args.out, "--jobs", str(args.jobs)]
    if args.seed is not None or args.seeds is not None:
        first = 0 if args.seed is None else args.seed
        count = len(load_study(args.study).seeds) if args.seeds is None else args.seeds
        out += ["--seeds", *map(str, range(first, first + count))]
    return out


LEGACY = (
    "The CPU learning suite is now the pre-registered study harness `mars2-study` (docs/study.md): "
    "this runs configs/study/team_vs_alone.yaml, then writes its report."
)


def legacy_main(argv: list[str] | None = None) -> None:
    """``python scripts/learning_curve.py [--seeds N] [--seed S] [--out DIR]``: run and report."""
    args = legacy_arguments(sys.argv[1:] if argv is None else argv)
    main(["run", *args])
    main(["report", *args])
