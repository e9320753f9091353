"""The study's analysis from the raw runs alone (``runs.jsonl``): measures per seed, the
pre-registered comparisons, Holm over the primary family, TOST, the manipulation and A/A checks.

The result (``summary.json``) is a pure function of the runs and the study file: rerunning it on
the committed ``runs.jsonl`` gives the same file byte for byte.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mars2.eval.intervals import mean_interval
from mars2.study.spec import Study
from mars2.study.stats import describe, holm

ROUND = 12  # digits kept in summary.json: float sums are exact to far more than this


def load_runs(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"no runs at {path}: run `mars2-study run <study>` first (or pass the --out the runs "
            "were written to)"
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _flat_team(rows_by_agent: list[list[dict[str, Any]]], budget: int) -> tuple[float, float]:
    """Flat sampling of a team at the tree's node budget: the first ``budget / agents`` samples of
    each agent, interleaved; the answer is the first passing the public tests (else the first
    sample), or the majority over identical programs among those passing public tests (all if
    none do; ties to the earliest). Returns (public-selection score, vote score)."""
    per = budget // len(rows_by_agent)
    first_total = vote_total = 0.0
    for rows in zip(*rows_by_agent, strict=True):
        samples = [(r["public"][j] == "1", r["passed"][j] == "1", r["programs"][j])
                   for j in range(per) for r in rows]  # fmt: skip
        public = [i for i, x in enumerate(samples) if x[0]]
        first_total += samples[public[0] if public else 0][1]
        pool = public or list(range(len(samples)))
        counts: dict[str, int] = {}
        for i in pool:
            counts[samples[i][2]] = counts.get(samples[i][2], 0) + 1
        top = max(counts.values())
        chosen = next(i for i in pool if counts[samples[i][2]] == top)
        vote_total += samples[chosen][1]
    n = len(rows_by_agent[0])
    return first_total / n, vote_total / n


def measures(runs: list[dict[str, Any]], study: Study | None = None) -> dict[str, dict[int, float]]:
    """measure -> seed -> value, for every measure the runs can give."""
    by_id = {r["id"]: r for r in runs if r.get("error") is None and r.get("result") is not None}
    out: dict[str, dict[int, float]] = {}

    def put(key: str, seed: int, value: float) -> None:
        out.setdefault(key, {})[seed] = float(value)

    for record in by_id.values():
        seed, result = int(record["seed"]), record["result"]
        if record["kind"] == "sample":
            source = record["spec"]["source"]
            if record["spec"]["stream"] != "test":
                source = "aa/" + source.split("/", 1)[1]
            for metric, key in (("pass1", "pass@1"), ("flat_public", "flat_public"),
                                ("flat_vote", "flat_vote")):  # fmt: skip
                put(f"{source}:{metric}", seed, result[key])
            for group, block in result["groups"].items():
                put(f"{source}:pass1[{group}]", seed, block["pass@1"])
        elif record["kind"] == "tree":
            name = record["spec"]["name"]
            put(f"{name}:mcts", seed, result["pass@1(mcts)"])
            put(f"{name}:passN", seed, result["pass@N"])
        elif record["kind"] == "warm":
            agent = record["spec"]["agent"]
            put(f"warm/{agent}:check", seed, result["check_pass@1"])
            put(f"warm/{agent}:loss", seed, result["losses"][-1])
        elif record["kind"] == "train":
            arm = record["spec"]["arm"]
            for agent in record["spec"]["members"]:
                steps = result["steps"]
                own = sum(sum(s["agents"][agent]["nodes"].values()) for s in steps)
                put(f"{arm}/{agent}:own_nodes_per_step", seed, own / max(1, len(steps)))
                tokens = sum(s["agents"][agent]["tokens"] for s in steps)
                put(f"{arm}/{agent}:tokens", seed, tokens)
            put(f"train/{arm}/{'+'.join(record['spec']['members'])}:wall", seed,
                result["wall_seconds"])  # fmt: skip
    if study is not None:  # flat sampling of each evaluation's team at the same node budget
        rows = {(r["spec"]["source"], int(r["seed"])): r["result"]["rows"]
                for r in by_id.values()
                if r["kind"] == "sample" and r["spec"]["stream"] == "test"}  # fmt: skip
        budget = int(study.settings["eval_nodes"])
        for evaluation in study.evaluations():
            for seed in sorted({int(r["seed"]) for r in runs}):
                team = [rows.get((source, seed)) for source in evaluation["agents"]]
                if all(team):  # every agent sampled (and with rows)
                    public, vote = _flat_team(team, budget)  # type: ignore[arg-type]
                    put(f"flat/{evaluation['name']}:public", seed, public)
                    put(f"flat/{evaluation['name']}:vote", seed, vote)
    for key in list(out):  # gains: trained minus this seed's warm start
        source, _, metric = key.partition(":")
        if metric == "pass1" and not source.startswith(("warm/", "aa/")):
            warm = out.get(f"warm/{source.split('/', 1)[1]}:pass1", {})
            out[f"{source}:gain"] = {s: v - warm[s] for s, v in out[key].items() if s in warm}
    return out


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, ROUND) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def verdict(c: dict[str, Any], alpha: float) -> str:
    """Pre-registered reading of one comparison (direction 'greater' or 'less')."""
    p = c.get("holm_p", c["sign_flip_p"])
    low, high = c["ci"]
    if c["n"] < 2 or low is None:
        return "inconclusive"
    sign = 1 if c["direction"] != "less" else -1
    if p < alpha and sign * c["mean"] > 0:
        return "supported"
    if (sign > 0 and high < 0) or (sign < 0 and low > 0):
        return "contradicted"
    return "inconclusive"


def analyse(study: Study, runs: list[dict[str, Any]]) -> dict[str, Any]:
    a = study.analysis
    alpha, margin, level = float(a["alpha"]), float(a["margin"]), float(a["level"])
    values = measures(runs, study)
    seeds = sorted({int(r["seed"]) for r in runs})
    failed = sorted(r["id"] for r in runs if r.get("error") is not None)
    comparisons = study.comparisons()
    primary_size = sum(c["family"] == "primary" for c in comparisons)
    secondary_size = len(comparisons) - primary_size
    results: list[dict[str, Any]] = []
    for c in comparisons:
        first, second = values.get(c["a"], {}), values.get(c["b"], {})
        used = [s for s in seeds if s in first and s in second]
        diffs = [first[s] - second[s] for s in used]
        entry: dict[str, Any] = {"id": c["id"], "family": c["family"], "a": c["a"], "b": c["b"],
                                 "direction": c.get("direction", "greater"),
                                 "label": c.get("label", ""), "seeds": used,
                                 "missing_seeds": [s for s in seeds if s not in used]}  # fmt: skip
        if diffs:
            size = primary_size if c["family"] == "primary" else max(1, secondary_size)
            entry.update(describe(diffs, entry["direction"], margin, level, alpha, size))
        else:
            entry.update({"n": 0, "mean": None, "ci": [None, None], "sign_flip_p": None})
        results.append(entry)
    primary = [r for r in results if r["family"] == "primary" and r.get("sign_flip_p") is not None]
    for r, p in zip(primary, holm([r["sign_flip_p"] for r in primary]), strict=True):
        r["holm_p"] = p
    for r in results:
        r["verdict"] = verdict(r, alpha) if r.get("sign_flip_p") is not None else "not run"
        if r.get("tost_p") is not None:
            r["equivalent_within_margin"] = r["tost_p"] < alpha
    checks = []
    for m in study.raw.get("manipulation", []):
        v = values.get(m, {})
        interval = mean_interval([v[s] for s in sorted(v)], level) if v else None
        passed = interval is not None and interval.low is not None and interval.low > 0
        checks.append({"measure": m, "n": len(v), "mean": interval.mean if interval else None,
                       "ci": interval.bounds if interval else [None, None], "passed": passed})  # fmt: skip
    aa = {}
    for agent in study.agents:
        first, second = values.get(f"warm/{agent}:pass1", {}), values.get(f"aa/{agent}:pass1", {})
        used = [s for s in seeds if s in first and s in second]
        if used:
            d = [second[s] - first[s] for s in used]
            interval = mean_interval(d, level)
            aa[agent] = {"n": len(d), "diffs": d, "mean": interval.mean, "ci": interval.bounds,
                         "mean_abs": math.fsum(abs(x) for x in d) / len(d)}  # fmt: skip
    table = {}
    for key, v in sorted(values.items()):
        interval = mean_interval([v[s] for s in sorted(v)], level)
        table[key] = {"n": len(v), "mean": interval.mean, "ci": interval.bounds,
                      "per_seed": {str(s): v[s] for s in sorted(v)}}  # fmt: skip
    cost: dict[str, dict[str, float]] = {}
    for r in runs:  # where the time went: per job kind, wall and CPU (job process + sandbox)
        entry = cost.setdefault(r["kind"], {"jobs": 0, "wall_seconds": 0.0, "cpu_seconds": 0.0})
        entry["jobs"] += 1
        entry["wall_seconds"] += float(r.get("job_wall_seconds", 0.0))
        result = r.get("result") or {}
        entry["cpu_seconds"] += float(result.get("cpu_seconds", 0.0))
        entry["cpu_seconds"] += float(result.get("sandbox_cpu_seconds", 0.0))
    summary = {
        "study": study.name,
        "cost": cost,
        "seeds": seeds,
        "failed_runs": failed,
        "runs": len(runs),
        "analysis": {
            "alpha": alpha,
            "margin": margin,
            "level": level,
            "primary": "Holm over the primary family on exact one-sided sign-flip p",
            "mde": "one-sided paired t, power 0.8, alpha / family size",
        },
        "comparisons": results,
        "manipulation": {"checks": checks, "passed": all(c["passed"] for c in checks)},
        "aa": aa,
        "measures": table,
    }
    return _clean(summary)


def write_summary(summary: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
