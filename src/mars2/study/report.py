"""The study's Markdown report and plot, from ``summary.json`` alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "–"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _ci(ci: list[float | None]) -> str:
    if ci[0] is None or ci[1] is None:
        return "–"
    return f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.4f}"


def report_markdown(summary: dict[str, Any], study_raw: dict[str, Any]) -> str:
    lines = [f"# Study `{summary['study']}`", ""]
    seeds = summary["seeds"]
    lines += [f"Seeds: {', '.join(map(str, seeds))} (n = {len(seeds)}); runs recorded: "
              f"{summary['runs']}; failed: {len(summary['failed_runs'])}"
              + (f" ({', '.join(summary['failed_runs'])})" if summary["failed_runs"] else "")
              + ".", ""]  # fmt: skip
    manipulation = summary["manipulation"]
    if not manipulation["passed"]:
        lines += ["**Manipulation check FAILED: the study is uninformative** (an alone arm did not "
                  "learn: its gain interval is not above 0). The comparisons below are reported "
                  "as measured, but no hypothesis can be read from them.", ""]  # fmt: skip
    a = summary["analysis"]
    level = round(100 * a["level"])
    lines += [f"## Primary hypotheses (Holm at α = {a['alpha']:g} over the family)", "",
              f"| id | comparison | mean diff | {level}% paired-t interval | exact sign-flip p | "
              f"Holm p | TOST p (±{a['margin']:g}) | MDE | verdict |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for c in summary["comparisons"]:
        if c["family"] != "primary":
            continue
        lines.append(f"| {c['id']} | {c['a']} − {c['b']} ({c['direction']}) | {_f(c['mean'])} | "
                     f"{_ci(c['ci'])} | {_p(c['sign_flip_p'])} | {_p(c.get('holm_p'))} | "
                     f"{_p(c.get('tost_p'))} | {_f(c.get('mde'), False)} | {c['verdict']} |")  # fmt: skip
    lines += ["", "Verdict rule (pre-registered): *supported* if the Holm-adjusted exact p < α and "
              "the mean is in the stated direction; *contradicted* if the whole interval lies on "
              "the other side of 0; otherwise *inconclusive* (then TOST p < α reads 'equivalent "
              "within the margin'). The smallest possible sign-flip p with n seeds is 1/2^n.", ""]  # fmt: skip
    lines += [
        "## Manipulation check: every alone arm learns (gain interval above 0)",
        "",
        "| measure | n | mean gain | interval | passed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in manipulation["checks"]:
        lines.append(f"| {c['measure']} | {c['n']} | {_f(c['mean'])} | {_ci(c['ci'])} | "
                     f"{'yes' if c['passed'] else 'NO'} |")  # fmt: skip
    lines += ["", "## A/A check: the warm start evaluated on two sample streams", "",
              "| agent | n | mean (stream B − A) | interval | mean absolute |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for agent, v in summary["aa"].items():
        lines.append(f"| {agent} | {v['n']} | {_f(v['mean'])} | {_ci(v['ci'])} | "
                     f"{_f(v['mean_abs'], False)} |")  # fmt: skip
    lines += ["", "## Exploratory comparisons (not in the primary family; no correction)", "",
              "| id | comparison | mean diff | interval | sign-flip p | TOST p | reading |",
              "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for c in summary["comparisons"]:
        if c["family"] == "primary":
            continue
        lines.append(f"| {c['id']} | {c['a']} − {c['b']} | {_f(c['mean'])} | {_ci(c['ci'])} | "
                     f"{_p(c['sign_flip_p'])} | {_p(c.get('tost_p'))} | {c['verdict']} |")  # fmt: skip
    cost = summary.get("cost", {})
    if cost:
        lines += ["", "## Where the time went (per job kind, summed over jobs)", "",
                  "| job kind | jobs | wall s (sum over workers) | CPU s (job + sandbox) |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for kind, c in cost.items():
            lines.append(f"| {kind} | {c['jobs']} | {c['wall_seconds']:.0f} | "
                         f"{c['cpu_seconds']:.0f} |")  # fmt: skip
        total = sum(c["cpu_seconds"] for c in cost.values())
        lines += ["", f"CPU in jobs: {total:.0f} s (about {total / 120:.0f} min on 2 idle cores, "
                  "before process start-up and model loading outside the jobs' clocks)."]  # fmt: skip
    lines += [
        "",
        "## Every measure (mean over seeds, interval)",
        "",
        "| measure | n | mean | interval |",
        "| --- | --- | --- | --- |",
    ]
    for key, v in summary["measures"].items():
        lines.append(f"| {key} | {v['n']} | {_f(v['mean'], False)} | {_ci(v['ci'])} |")
    samples = study_raw["settings"]["test_samples"]
    lines += ["", f"Measures: `<arm>/<agent>:pass1` test pass@1 ({samples} samples per problem) of the "
              "trained agent, `:gain` minus its warm start, `:flat_public` / `:flat_vote` flat "
              "sampling at the same budget (answer chosen by public tests / majority vote), "
              "`<tree>:mcts` / `:passN` Pass@1(MCTS) / Pass@N of an evaluation tree, "
              "`warm/<agent>:check` the warm start's reached skill (covariate), "
              "`:own_nodes_per_step` own nodes per training step.", ""]  # fmt: skip
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Left: each comparison's mean difference with its interval; right: test pass@1 and trees."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparisons = [c for c in summary["comparisons"] if c.get("mean") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, max(4, 0.35 * len(comparisons) + 2)))
    for i, c in enumerate(comparisons):
        low, high = c["ci"]
        color = "C3" if c["family"] == "primary" else "C0"
        if low is not None and high is not None:
            left.plot([low, high], [i, i], color=color)
        left.plot([c["mean"]], [i], "o", color=color)
    left.axvline(0, color="k", lw=0.8)
    left.set_yticks(range(len(comparisons)), [c["id"] for c in comparisons], fontsize=7)
    left.invert_yaxis()
    left.set(xlabel="paired difference (red: primary)", title="comparisons, 95% intervals")
    keys = [k for k in summary["measures"] if k.endswith((":pass1", ":mcts"))]
    means = [summary["measures"][k]["mean"] for k in keys]
    errors = [0.0 if summary["measures"][k]["ci"][1] is None else
              summary["measures"][k]["ci"][1] - summary["measures"][k]["mean"] for k in keys]  # fmt: skip
    right.barh(range(len(keys)), means, xerr=errors, alpha=0.7)
    right.set_yticks(range(len(keys)), keys, fontsize=7)
    right.invert_yaxis()
    right.set(xlabel="test score (mean over seeds)", xlim=(0, 1))
    fig.suptitle(f"study {summary['study']}: n = {len(summary['seeds'])} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
