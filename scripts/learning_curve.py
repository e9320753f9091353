"""Does the team beat one agent? The CPU learning suite (offline, deterministic per seed).

Task (``mars2.data.skills``, fixed before any team result; see docs/learning.md):
two-skill arithmetic. tiny_qwen3 is warm-started on the ``add`` skill (+ -), tiny_llama on the
``mul`` skill (* //), each with a glimpse (two problems per operator) of the other; RL training
and held-out problems mix both skills and compositions that need both. Every warm start (once per seed) runs
until the agent solves ``--warm-pass`` of its skill's check problems, the same skill for both
agents (the same loss leaves them at very different skill); every method starts from those weights.

Methods, at equal generation budget (``--problems-per-step`` x ``--nodes`` completions per step,
``--steps`` steps, the same problem schedule, seed and warm starts):

- vanilla GRPO, each agent alone (independent samples, no shaping);
- single-agent tree, each agent alone (MARS² search and shaping with one agent);
- MARS² pair: tiny_qwen3 + tiny_llama in one tree per problem;
- a homogeneous pair: two copies of tiny_qwen3 with their own optimizers (the paper's Homo
  setting; one such pair, not one per agent, keeps the suite within 30 minutes on 2 cores);
- pair ablations: no shaping (gamma = 0), uniform agent assignment, ``bandit`` strategy.

Measured: each agent's held-out pass@1 every ``--eval-every`` steps (``--eval-samples`` seeded
samples per problem: methods sharing a warm start share the step-0 value exactly), and at the end
Pass@1(MCTS) / Pass@N of each agent's own tree and of the team's tree on the held-out problems
(``--eval-nodes`` nodes, searched on public tests, judged on all). Over the seeds: mean with 95%
Student-t intervals, and paired per-seed differences. Writes under ``--out``: ``summary.json``
(``methods``: per method and agent ``gain_mean``, ``gain_ci95``, ``final_mean``, ``final_ci95``;
``paired``: ``diff_mean``, ``diff_ci95`` per comparison), ``details.json`` (the end-of-run trees
with intervals, the settings), ``runs.json`` (every run's curves, per-group scores, trees and
cost) and ``learning_curve.png``.

    python scripts/learning_curve.py --seeds 5            # the whole suite
    python scripts/learning_curve.py --seeds 1 --steps 3 --eval-every 1   # a smoke run

Runs go ``--jobs`` at a time, one torch thread each; each finished run is kept under
``--out/runs`` with its settings and the code's version, and reused by a rerun with both equal.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SKILL = {"tiny_qwen3": "add", "tiny_llama": "mul"}  # the skill each agent's warm start is built on
A, B = "tiny_qwen3", "tiny_llama"


@dataclass(frozen=True)
class Method:
    """One arm: its members (member name -> base agent), search and shaping."""

    name: str
    members: tuple[tuple[str, str], ...]
    search: str = "mars2"  # grpo: independent samples | mars2: one tree per problem
    gamma: float = 0.5  # shaping strength, set explicitly for every method
    policy: tuple[tuple[str, str], ...] = field(default=())  # search.config.policy overrides

    @property
    def is_team(self) -> bool:
        return len(self.members) > 1

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.name.lower()).strip("_")


HETERO = ((A, A), (B, B))
METHODS = (
    Method(f"vanilla GRPO ({A})", ((A, A),), "grpo", 0.0),
    Method(f"vanilla GRPO ({B})", ((B, B),), "grpo", 0.0),
    Method(f"single-agent tree ({A})", ((A, A),)),
    Method(f"single-agent tree ({B})", ((B, B),)),
    Method(f"MARS2 pair ({A} + {B})", HETERO),
    Method(f"homogeneous pair ({A} x2)", ((A, A), (f"{A}_copy", A))),
    Method("pair, no shaping (gamma=0)", HETERO, gamma=0.0),
    Method("pair, uniform agent assignment", HETERO, policy=(("assignment", "uniform"),)),
    Method("pair, bandit strategy", HETERO, policy=(("strategy", "bandit"),)),
)
BY_NAME = {m.name: m for m in METHODS}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a run's result depends on besides its method and seed."""
    keys = ("steps", "problems_per_step", "nodes", "eval_every", "eval_samples", "eval_nodes",
            "warm_pass", "check_every", "check_below_loss", "warm_max_epochs", "temperature",
            "lr", "max_new_tokens")  # fmt: skip
    return {**{k: getattr(args, k) for k in keys}, "code": code_version()}


def code_version() -> str:
    """A hash of the code (committed trees of src, scripts and configs plus uncommitted changes to
    them): a finished run is reused only by the same code, whatever else a commit changed (docs);
    outside a git checkout nothing is reused."""
    import hashlib
    import subprocess

    code = ("src", "scripts", "configs")
    try:
        trees = subprocess.run(["git", "rev-parse", *(f"HEAD:{d}" for d in code)], cwd=REPO,
                               capture_output=True, check=True).stdout  # fmt: skip
        diff = subprocess.run(["git", "diff", "HEAD", "--", *code], cwd=REPO,
                              capture_output=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return f"unknown-{time.time()}"
    return hashlib.sha256(trees + diff).hexdigest()[:16]


def _digest(settings: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def _worker_init() -> None:
    import torch

    # Tiny models: one thread per run is several times faster than two fighting for the cores.
    torch.set_num_threads(1)


def warm_start_job(base: str, target: str, agent_name: str, seed: int, s: dict[str, Any]) -> str:
    """Warm-start one agent on its skill's warm-start part until it solves ``warm_pass`` of its
    skill's check problems (sampled pass@1, checked every ``check_every`` epochs once the loss is
    at most ``check_below_loss``); returns a log line."""
    import tempfile

    from hydra import compose, initialize_config_dir

    from mars2.builders import build_grader, build_sandbox
    from mars2.data.sources import skills
    from mars2.eval.runner import ResultStore, evaluate_sampling, summarise_sampling
    from mars2.generation.factory import build_generators
    from mars2.models.loading import ModelSpec
    from mars2.training.agent_module import AgentModule, GenerationConfig
    from mars2.training.warm_start import WarmStartConfig, warm_start

    began = time.process_time()
    generation = GenerationConfig(max_new_tokens=s["max_new_tokens"], temperature=s["temperature"])
    agent = AgentModule(agent_name, ModelSpec(f"{base}/{agent_name}"), generation)
    generator = build_generators({agent_name: agent})[agent_name]
    problems = skills(f"warm_start_{SKILL[agent_name]}")
    checks = skills(f"warm_check_{SKILL[agent_name]}")
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["logger=none", "grader.dedupe=true"])
    sandbox = build_sandbox(cfg)
    grader = build_grader(cfg, sandbox)
    history: list[tuple[int, float, float]] = []

    def skilled(epoch: int, loss: float) -> bool:
        if loss > s["check_below_loss"] or epoch % s["check_every"]:
            return False
        generator.catch_up()
        with tempfile.TemporaryDirectory() as tmp:
            store = ResultStore(f"{tmp}/check.jsonl")
            evaluate_sampling(checks, generator, grader, 4, store, seed=seed, stream="warm_check")
            score = summarise_sampling(agent_name, list(store.rows.values())).metrics["pass@1"]
        history.append((epoch, loss, score))
        return score >= s["warm_pass"]

    try:
        config = WarmStartConfig(epochs=s["warm_max_epochs"], seed=seed)
        losses = warm_start(agent, problems, config, stop=skilled)
    finally:
        sandbox.close()
    if not history or history[-1][2] < s["warm_pass"]:
        raise RuntimeError(
            f"the warm start of {agent_name} (seed {seed}) did not reach pass@1 {s['warm_pass']} "
            f"on its check problems in {len(losses)} epochs (checks: {history}): raise "
            "--warm-max-epochs"
        )
    agent.save_pretrained(f"{target}/{agent_name}")
    (Path(target) / agent_name / "warm_start.json").write_text(
        json.dumps({"losses": losses, "checks": history, "settings": s})
    )
    return (
        f"warm start {agent_name} (seed {seed}): loss {losses[0]:.3f} -> {losses[-1]:.3f}, check "
        f"pass@1 {history[-1][2]:.2f} after {len(losses)} epochs on {len(problems)} problems, "
        f"{time.process_time() - began:.0f}s CPU"
    )


def run_job(
    method_name: str, seed: int, models: str, out: str, s: dict[str, Any]
) -> dict[str, Any]:
    """Train one method for one seed; returns its curves, final trees and cost."""
    import resource

    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from mars2.data.sources import skills
    from mars2.eval.callbacks import HeldOutEvalCallback, TreeEvalCallback
    from mars2.search.runner import SearchConfig
    from mars2.training.run import build_run

    started = time.process_time()
    # A pool worker runs several jobs: its reaped children's CPU time (the sandbox's) is counted
    # from here, not from the worker's start.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    method = BY_NAME[method_name]
    bases = sorted({base for _, base in method.members}, key=[A, B].index)
    per_agent = [f"generation.temperature={s['temperature']}", f"optim.lr={s['lr']}",
                 f"generation.max_new_tokens={s['max_new_tokens']}",
                 f"loss.max_tokens={s['max_new_tokens']}"]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "experiment=tiny_grpo" if method.search == "grpo" else "experiment=tiny_pair",
                f"agent=[{','.join(bases)}]",
                "data=skills",
                "warm_start=null",  # done once per seed, shared by every method
                f"paths.tiny_models_dir={models}",
                f"paths.output_dir={out}",
                f"paths.log_dir={out}/logs",
                "logger=csv",
                "grader.dedupe=true",  # identical answers to one problem run once (same verdicts)
                "callbacks.checkpoint=null",
                "callbacks.views=null",
                "~callbacks.progress",
                "callbacks.multi_agent.save_trees_every=8",
                "+callbacks.multi_agent.save_final_agents=false",
                "+trainer.enable_progress_bar=false",
                f"steps={s['steps']}",
                f"problems_per_step={s['problems_per_step']}",
                f"search.config.max_nodes={s['nodes']}",
                f"advantage.gamma={method.gamma}",
                *(f"search.config.policy.{key}={value}" for key, value in method.policy),
                f"seed={seed}",
                *(f"agents.{base}.{o}" for base in bases for o in per_agent),
            ],
        )
    with open_dict(cfg):
        for member, base in method.members:  # a homogeneous pair's second copy
            if member != base:
                cfg.agents[member] = cfg.agents[base].copy()
                cfg.agents[member].name = member
    module, datamodule, trainer, sandbox = build_run(cfg)
    held_out = skills("held_out")
    # Every method starts from this seed's warm start: its step-0 evaluation is done once.
    step0 = Path(models) / f"heldout_step0_{_digest(s)}"
    curves = HeldOutEvalCallback(held_out, s["eval_every"], s["eval_samples"], seed=seed,
                                 start_cache=step0)  # fmt: skip
    trees = TreeEvalCallback(held_out, SearchConfig(max_nodes=s["eval_nodes"]), seed=seed)
    trainer.callbacks.extend([curves, trees])
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    sandbox_cpu = (children.ru_utime - before.ru_utime) + (children.ru_stime - before.ru_stime)
    members = {member: base for member, base in method.members}
    return {
        "method": method.name,
        "seed": seed,
        "settings": s,
        "members": members,
        "curve": {m: {st: v for st, a, v in curves.history if a == m} for m in members},
        "groups": {m: {st: g for st, a, g in curves.groups if a == m} for m in members},
        "trees": trees.results,
        "wall_seconds": time.perf_counter() - wall,
        "cpu_seconds": time.process_time() - cpu,
        "job_cpu_seconds": time.process_time() - started,  # with config, model loading
        "held_out_cpu_seconds": curves.cpu_seconds,
        "tree_cpu_seconds": trees.cpu_seconds,
        "sandbox_cpu_seconds": sandbox_cpu,
    }


def _run_path(out: Path, method: Method, seed: int) -> Path:
    return out / "runs" / method.slug / f"seed{seed}.json"


def _cached(path: Path, s: dict[str, Any]) -> dict[str, Any] | None:
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result if result.get("settings") == s else None


def _curve(raw: dict[str, float]) -> dict[int, float]:
    return {int(step): value for step, value in raw.items()}


def run_all(
    args: argparse.Namespace, methods: list[Method], seeds: list[int]
) -> list[dict[str, Any]]:
    """Warm starts, then every (method, seed) run not already done, `--jobs` at a time."""
    s = settings_of(args)
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_worker_init)
    try:
        warm = []
        for seed in seeds:
            target = args.out / "warm" / f"seed{seed}"
            for agent in (A, B):
                marker = target / agent / "warm_start.json"
                if marker.exists() and json.loads(marker.read_text())["settings"] == s:
                    continue
                warm.append(
                    pool.submit(warm_start_job, str(args.tiny), str(target), agent, seed, s)
                )
        for job in warm:
            print(job.result(), flush=True)
        jobs = {}
        # Seed by seed, so that a suite cut short leaves whole seeds (``--seeds`` fewer then
        # summarises them from the kept runs); within a seed teams first, as they take longest.
        for seed in seeds:
            for method in sorted(methods, key=lambda m: not m.is_team):
                path = _run_path(args.out, method, seed)
                if _cached(path, s) is None:
                    models = str(args.out / "warm" / f"seed{seed}")
                    work = str(args.out / "work" / method.slug / f"seed{seed}")
                    jobs[path] = pool.submit(run_job, method.name, seed, models, work, s)
        for path, job in jobs.items():
            result = job.result()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))
            print(f"{result['method']} (seed {result['seed']}): {result['wall_seconds']:.0f}s wall, "
                  f"{result['cpu_seconds'] + result['sandbox_cpu_seconds']:.0f}s CPU", flush=True)  # fmt: skip
    finally:  # a failed run stops the suite at once: queued runs are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)
    results = []
    for method in methods:
        for seed in seeds:
            result = _cached(_run_path(args.out, method, seed), s)
            assert result is not None
            results.append(result)
    return results


def summarise(results: list[dict[str, Any]], methods: list[Method]) -> dict[str, Any]:
    """The summary.json: per method and agent, gain and final held-out pass@1 with 95% intervals;
    per method, the end-of-run trees; paired per-seed differences."""
    from mars2.eval.intervals import gain, mean_interval, paired_interval

    def block(values: dict[int, float]) -> dict[str, Any]:
        interval = mean_interval([values[k] for k in sorted(values)])
        return {"mean": interval.mean, "ci95": interval.bounds}

    runs = {(r["method"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    final: dict[tuple[str, str], dict[int, float]] = {}  # (method, member) -> seed -> value
    gains: dict[tuple[str, str], dict[int, float]] = {}
    tree: dict[tuple[str, str, str], dict[int, float]] = {}  # (method, setting, metric)
    # trees and groups go to details.json
    summary: dict[str, Any] = {"methods": {}, "paired": {}, "trees": {}, "groups": {}}
    for method in methods:
        summary["methods"][method.name] = {}
        for member, _ in method.members:
            curves = {s: _curve(runs[(method.name, s)]["curve"][member]) for s in seeds}
            gains[(method.name, member)] = {s: gain(c) for s, c in curves.items()}
            final[(method.name, member)] = {s: gain(c) + c[0] for s, c in curves.items()}
            g, f = block(gains[(method.name, member)]), block(final[(method.name, member)])
            summary["methods"][method.name][member] = {
                "gain_mean": g["mean"], "gain_ci95": g["ci95"],
                "final_mean": f["mean"], "final_ci95": f["ci95"],
            }  # fmt: skip
            # Per problem group (add, mul, composition): step 0 and the mean of the last three.
            by_group: dict[str, Any] = {}
            for s in seeds:
                raw = runs[(method.name, s)]["groups"][member]
                steps = sorted(raw, key=int)
                for group in raw[steps[0]]:
                    start = raw[steps[0]][group]
                    end = float(np.mean([raw[st][group] for st in steps[-3:]]))
                    by_group.setdefault(group, {"start": {}, "final": {}})
                    by_group[group]["start"][s], by_group[group]["final"][s] = start, end
            summary["groups"].setdefault(method.name, {})[member] = {
                group: {f"{k}_{part}": v for part, values in parts.items()
                        for k, v in block(values).items()}
                for group, parts in sorted(by_group.items())
            }  # fmt: skip
        summary["trees"][method.name] = {}
        for setting in runs[(method.name, seeds[0])]["trees"]:
            entry = {}
            for metric in ("pass@1(mcts)", "pass@N"):
                values = {s: runs[(method.name, s)]["trees"][setting][metric] for s in seeds}
                tree[(method.name, setting, metric)] = values
                b = block(values)
                entry[f"{metric}_mean"], entry[f"{metric}_ci95"] = b["mean"], b["ci95"]
            summary["trees"][method.name][setting] = entry

    def pair(label: str, first: dict[int, float], second: dict[int, float]) -> None:
        interval = paired_interval(first, second)
        summary["paired"][label] = {"diff_mean": interval.mean, "diff_ci95": interval.bounds}

    names = {m.name for m in methods}
    for team in (m for m in methods if m.is_team):
        for member, _ in team.members:  # the team's tree against each member's, same weights
            for metric in ("pass@1(mcts)", "pass@N"):
                pair(f"{team.name} team tree - its [{member}] own tree: {metric}",
                     tree[(team.name, "team", metric)], tree[(team.name, member, metric)])  # fmt: skip
        for member, base in team.members:
            for alone in (f"vanilla GRPO ({base})", f"single-agent tree ({base})"):
                if alone not in names:
                    continue
                pair(f"{team.name} [{member}] - {alone}: held-out pass@1",
                     final[(team.name, member)], final[(alone, base)])  # fmt: skip
                if member == base and (alone, base) in {(k[0], k[1]) for k in tree}:
                    for metric in ("pass@1(mcts)", "pass@N"):
                        pair(f"{team.name} team tree - {alone} own tree: {metric}",
                             tree[(team.name, "team", metric)], tree[(alone, base, metric)])  # fmt: skip
    hetero = f"MARS2 pair ({A} + {B})"
    if hetero in names:
        for other in (m for m in methods if m.is_team and m.name != hetero):
            for member, base in other.members:
                if member == base:
                    pair(f"{hetero} [{base}] - {other.name} [{base}]: held-out pass@1",
                         final[(hetero, base)], final[(other.name, base)])  # fmt: skip
            for metric in ("pass@1(mcts)", "pass@N"):
                pair(f"{hetero} team tree - {other.name} team tree: {metric}",
                     tree[(hetero, "team", metric)], tree[(other.name, "team", metric)])  # fmt: skip
    return summary


def plot(results: list[dict[str, Any]], methods: list[Method], path: Path) -> None:
    """Held-out pass@1 per agent (one panel each, 95% bands), and the end-of-run trees."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mars2.eval.intervals import mean_interval

    seeds = sorted({r["seed"] for r in results})
    runs = {(r["method"], r["seed"]): r for r in results}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, agent in zip(axes[:2], (A, B), strict=True):
        for method in methods:
            members = [m for m, base in method.members if base == agent]
            if not members:
                continue
            per_seed = [
                {st: np.mean([_curve(runs[(method.name, s)]["curve"][m])[st] for m in members])
                 for st in _curve(runs[(method.name, s)]["curve"][members[0]])}
                for s in seeds
            ]  # fmt: skip
            steps = sorted(per_seed[0])
            intervals = [mean_interval([p[st] for p in per_seed]) for st in steps]
            mean = np.array([i.mean for i in intervals])
            ax.plot(steps, mean, marker="o", ms=3, label=method.name)
            if len(seeds) > 1:
                lows = np.array([i.low for i in intervals], dtype=float)
                highs = np.array([i.high for i in intervals], dtype=float)
                ax.fill_between(steps, lows, highs, alpha=0.12)
        ax.set(xlabel="training step", ylabel="held-out pass@1", title=agent, ylim=(0, 1))
        ax.legend(fontsize=7)
    ax = axes[2]
    labels, means, errors = [], [], []
    for method in methods:
        for setting in runs[(method.name, seeds[0])]["trees"]:
            if method.is_team and setting != "team":
                continue
            values = [runs[(method.name, s)]["trees"][setting]["pass@1(mcts)"] for s in seeds]
            interval = mean_interval(values)
            labels.append(method.name)
            means.append(interval.mean)
            errors.append(0.0 if interval.high is None else interval.high - interval.mean)
    ax.barh(range(len(labels)), means, xerr=errors, alpha=0.7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="held-out Pass@1(MCTS) at the end (team tree for pairs)", xlim=(0, 1))
    n = len(seeds)
    fig.suptitle(f"Two-skill arithmetic, mean and 95% interval over {n} seed{'s' * (n > 1)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _cell(mean: float, bounds: list[float | None]) -> str:
    if bounds[0] is None or bounds[1] is None:
        return f"{mean:+.3f}"
    return f"{mean:+.3f} [{bounds[0]:+.3f}, {bounds[1]:+.3f}]"


def print_tables(summary: dict[str, Any]) -> None:
    """Markdown tables of the summary (the README's)."""
    print("\n| method | agent | final held-out pass@1 | gain from step 0 |")
    print("| --- | --- | --- | --- |")
    for method, agents in summary["methods"].items():
        for agent, v in agents.items():
            print(f"| {method} | {agent} | {_cell(v['final_mean'], v['final_ci95'])} | "
                  f"{_cell(v['gain_mean'], v['gain_ci95'])} |")  # fmt: skip
    print("\n| method | tree | Pass@1(MCTS) | Pass@N |")
    print("| --- | --- | --- | --- |")
    for method, settings in summary["trees"].items():
        for setting, v in settings.items():
            print(f"| {method} | {setting} | {_cell(v['pass@1(mcts)_mean'], v['pass@1(mcts)_ci95'])} "
                  f"| {_cell(v['pass@N_mean'], v['pass@N_ci95'])} |")  # fmt: skip
    print("\n| method | agent | group | held-out pass@1 at step 0 | final |")
    print("| --- | --- | --- | --- | --- |")
    for method, agents in summary["groups"].items():
        for agent, groups in agents.items():
            for group, v in groups.items():
                print(f"| {method} | {agent} | {group} | {_cell(v['mean_start'], v['ci95_start'])} "
                      f"| {_cell(v['mean_final'], v['ci95_final'])} |")  # fmt: skip
    print("\n| paired per-seed difference | mean [95% interval] |")
    print("| --- | --- |")
    for label, v in summary["paired"].items():
        print(f"| {label} | {_cell(v['diff_mean'], v['diff_ci95'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "logs" / "learning_curve")
    parser.add_argument("--tiny", type=Path, default=REPO / ".cache" / "tiny_models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=5, help="repeat for seed..seed+N-1")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--problems-per-step", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=8,
                        help="completions per problem per step, every method")  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--eval-nodes", type=int, default=8, help="node budget of the final trees")
    parser.add_argument("--warm-pass", type=float, default=0.5,
                        help="every warm start ends once the agent solves this share of its "
                             "skill's check problems")  # fmt: skip
    parser.add_argument("--check-every", type=int, default=2, help="warm-start epochs per check")
    parser.add_argument("--check-below-loss", type=float, default=0.2,
                        help="checks start once the warm-start loss is at most this")  # fmt: skip
    parser.add_argument("--warm-max-epochs", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one core each)")
    parser.add_argument("--methods", nargs="+", choices=[m.slug for m in METHODS],
                        help="only these methods (default: all)")  # fmt: skip
    args = parser.parse_args()
    if args.steps < 3 * args.eval_every:
        parser.error("the gain needs 4 evaluations: --steps >= 3 x --eval-every")
    from mars2.models.tiny import make_tiny_models

    args.out.mkdir(parents=True, exist_ok=True)
    make_tiny_models(args.tiny)
    methods = [m for m in METHODS if not args.methods or m.slug in args.methods]
    seeds = list(range(args.seed, args.seed + args.seeds))
    began = time.perf_counter()
    results = run_all(args, methods, seeds)
    summary = summarise(results, methods)
    details = {"trees": summary.pop("trees"), "groups": summary.pop("groups"),
               "settings": {**settings_of(args), "seeds": seeds}}  # fmt: skip
    (args.out / "runs.json").write_text(json.dumps(results, indent=1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))  # the shape
    (args.out / "details.json").write_text(json.dumps(details, indent=1))
    plot(results, methods, args.out / "learning_curve.png")
    print_tables({**summary, **details})
    import resource

    # Every process of this suite (the pool's workers and their sandboxes are reaped by now): on
    # a shared machine wall time says little, CPU time / cores estimates an idle machine's.
    cpu = sum(
        usage.ru_utime + usage.ru_stime
        for usage in (
            resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
    )
    print(f"\n{len(results)} runs in {time.perf_counter() - began:.0f}s wall, {cpu:.0f}s CPU in "
          f"all processes (about {cpu / args.jobs:.0f}s on {args.jobs} idle cores); wrote "
          f"{args.out / 'summary.json'} and {args.out / 'learning_curve.png'}")  # fmt: skip


if __name__ == "__main__":
    main()
