"""The study's jobs, each run in a pool worker: init + warm start, training, evaluations.

Every job takes plain JSON-able arguments and returns one JSON-able record (a line of
``runs.jsonl``); weights travel between jobs through folders under the study's work dir.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from mars2.training.callback import run_datamodule
from mars2.training.members import team_members

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def worker_init() -> None:
    import torch

    # Tiny models: one thread per run is several times faster than two fighting for the cores.
    torch.set_num_threads(1)


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS.resolve()), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _grader(task: dict[str, Any]) -> tuple[Any, Any]:
    from mars2.builders import build_grader, build_sandbox

    cfg = _compose(["logger=none", "grader.dedupe=true"])
    sandbox = build_sandbox(cfg)
    return sandbox, build_grader(cfg, sandbox)


def _problems(task: dict[str, Any], part: str, seed: int, limit: int | None = None) -> list[Any]:
    from mars2.data.sources import skills

    problems = skills(part, seed=seed, layout=task["layout"])
    if limit is None:
        return problems
    return problems[:: max(1, len(problems) // limit)][:limit]  # smoke studies: every group


def _agent(name: str, path: str, s: dict[str, Any]) -> Any:
    from mars2.models.loading import ModelSpec
    from mars2.training.agent_module import AgentModule, GenerationConfig

    generation = GenerationConfig(max_new_tokens=s["max_new_tokens"], temperature=s["temperature"])
    return AgentModule(name, ModelSpec(path), generation)


def _cost(began_wall: float, began_cpu: float, children: Any) -> dict[str, float]:
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    sandbox = (now.ru_utime - children.ru_utime) + (now.ru_stime - children.ru_stime)
    return {
        "wall_seconds": time.perf_counter() - began_wall,
        "cpu_seconds": time.process_time() - began_cpu,
        "sandbox_cpu_seconds": sandbox,
    }


def warm_job(task: dict[str, Any], s: dict[str, Any], agent_name: str, seed: int,
             target: str) -> dict[str, Any]:  # fmt: skip
    """This seed's own init of the agent (`make_tiny_models` seeded per seed), then a warm start
    of a fixed number of epochs on its skill's warm-start part (the rule every seed meets); the
    reached skill (sampled pass@1 on the check part) is logged as a covariate."""
    from mars2.eval.runner import ResultStore, evaluate_sampling, summarise_sampling
    from mars2.generation.factory import build_generators
    from mars2.models.tiny import make_tiny_models
    from mars2.training.warm_start import WarmStartConfig, warm_start

    wall, cpu = time.perf_counter(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    init = Path(target) / "init"
    # Each study seed its own init: seeds 2*seed (tiny_qwen3) and 2*seed+1 (tiny_llama).
    paths = make_tiny_models(init, seed=2 * seed)
    agent = _agent(agent_name, str(paths[agent_name]), s)
    generator = build_generators({agent_name: agent})[agent_name]
    skill = task["agents"][agent_name]
    problems = _problems(task, f"warm_start_{skill}", seed)
    checks = _problems(task, f"warm_check_{skill}", seed)
    sandbox, grader = _grader(task)
    try:
        config = WarmStartConfig(epochs=s["warm_epochs"], seed=seed)
        losses = warm_start(agent, problems, config)
        generator.catch_up()
        with tempfile.TemporaryDirectory() as tmp:
            store = ResultStore(f"{tmp}/check.jsonl")
            evaluate_sampling(checks, generator, grader, s["check_samples"], store, seed=seed,
                              stream="warm_check")  # fmt: skip
            check = summarise_sampling(agent_name, list(store.rows.values())).metrics["pass@1"]
    finally:
        sandbox.close()
    out = Path(target) / agent_name
    agent.save_pretrained(str(out))
    return {"losses": losses, "check_pass@1": check, "epochs": len(losses),
            "weights": str(out), **_cost(wall, cpu, children)}  # fmt: skip


class StepLog(pl.Callback):
    """Per step and agent: own nodes and reward variance by problem group, tokens, wall time."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, Any]] = []
        self._began = time.perf_counter()

    def on_train_batch_start(self, *_: Any) -> None:
        self._began = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           *_: Any) -> None:  # fmt: skip
        data = run_datamodule(trainer).last
        if data is None:
            return
        agents = list(team_members(pl_module))
        nodes: dict[str, Counter[str]] = {a: Counter() for a in agents}
        variance: dict[str, dict[str, list[float]]] = {a: defaultdict(list) for a in agents}
        tokens: Counter[str] = Counter()
        reward = defaultdict(list)
        for tree in data.trees:
            group = str(tree.problem.metadata.get("group", "all"))
            mine: dict[str, list[float]] = defaultdict(list)
            for node in tree.answers():
                if node.agent is None:
                    continue
                nodes[node.agent][group] += 1
                tokens[node.agent] += len(node.completion.token_ids)
                mine[node.agent].append(float(node.grade.reward))
                reward[node.agent].append(float(node.grade.reward))
            for agent, rewards in mine.items():
                variance[agent][group].append(statistics.pvariance(rewards))
        self.steps.append({
            "step": data.number,  # as shown and written everywhere (1 for the first)
            "wall_seconds": time.perf_counter() - self._began,
            "agents": {a: {
                "nodes": dict(nodes[a]),
                "reward_mean": statistics.fmean(reward[a]) if reward[a] else None,
                "reward_variance": {g: statistics.fmean(v) for g, v in variance[a].items()},
                "zero_variance_trees": {g: sum(x == 0 for x in v) for g, v in variance[a].items()},
                "tokens": tokens[a],
            } for a in agents},
        })  # fmt: skip


class SaveAgents(pl.Callback):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = Path(target)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, agent in team_members(pl_module).items():
            agent.save_pretrained(str(self.target / name))


def train_job(task: dict[str, Any], s: dict[str, Any], arm: dict[str, Any], seed: int,
              warm: dict[str, str], target: str) -> dict[str, Any]:  # fmt: skip
    """Train one arm for one seed from this seed's warm starts (``warm``: agent -> weights)."""
    from mars2.training.run import build_run

    wall, cpu = time.perf_counter(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    members = list(arm["members"])
    models = tempfile.mkdtemp(prefix="mars2-study-models-")
    for name in members:  # the run loads agents from <tiny_models_dir>/<name>
        Path(models, name).symlink_to(Path(warm[name]).resolve())
    per_agent = [f"generation.temperature={s['temperature']}", f"optim.lr={s['lr']}",
                 f"generation.max_new_tokens={s['max_new_tokens']}",
                 f"loss.max_tokens={s['max_new_tokens']}"]  # fmt: skip
    cfg = _compose([
        "experiment=tiny_grpo" if arm["search"] == "grpo" else "experiment=tiny_pair",
        f"agent=[{','.join(members)}]",
        "data=skills",
        f"+data.train.seed={seed}",
        f"+data.train.layout={task['layout']}",
        "data.eval.part=validation" if task["layout"] == "study" else "data.eval.part=held_out",
        f"+data.eval.seed={seed}",
        f"+data.eval.layout={task['layout']}",
        "warm_start=null",
        f"paths.tiny_models_dir={models}",
        f"paths.output_dir={target}/run",
        f"paths.log_dir={target}/run/logs",
        "logger=none",
        "grader.dedupe=true",
        "callbacks.checkpoint=null",
        "callbacks.views=null",
        "~callbacks.progress",
        "callbacks.multi_agent.save_trees_every=0",
        "+callbacks.multi_agent.save_final_agents=false",
        "+trainer.enable_progress_bar=false",
        f"steps={s['steps']}",
        f"problems_per_step={s['problems_per_step']}",
        f"search.config.max_nodes={arm['nodes']}",
        f"advantage.gamma={arm['gamma']}",
        f"seed={seed}",
        *(f"agents.{name}.{o}" for name in members for o in per_agent),
    ])  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    log, save = StepLog(), SaveAgents(f"{target}/weights")
    trainer.callbacks.extend([log, save])  # type: ignore[attr-defined]  # set in __init__
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    return {"weights": {name: f"{target}/weights/{name}" for name in members},
            "steps": log.steps, **_cost(wall, cpu, children)}  # fmt: skip


def sampling_seed(seed: int, stream: str, chunk: int) -> int:
    """The torch seed of one chunk of a sample stream: a function of (seed, stream, chunk) only,
    so one agent's weights in two arms see the same draws (common random numbers), and the A/A
    stream (another name) and every chunk get their own."""
    import numpy as np

    from mars2.eval.runner import chunk_seed

    return int(np.random.SeedSequence(chunk_seed(seed, stream, chunk)).generate_state(1)[0])


def _vote_key(code: str | None) -> str:
    return " ".join((code or "").split())  # identical programs up to whitespace


def _short(code: str | None) -> str:
    import hashlib

    return hashlib.sha256(_vote_key(code).encode()).hexdigest()[:8]


def sample_job(task: dict[str, Any], s: dict[str, Any], weights: str, agent_name: str,
               seed: int, stream: str, part: str) -> dict[str, Any]:  # fmt: skip
    """`samples` seeded samples per test problem: pass@1 (mean over samples), and two flat
    selections at the same budget: the first sample passing the public tests, and the majority
    vote over identical programs among those passing public tests (all samples if none do)."""
    import torch

    from mars2.eval.runner import metric_view
    from mars2.generation.factory import build_generators
    from mars2.search.prompts import PromptBuilder

    wall, cpu = time.perf_counter(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    agent = _agent(agent_name, weights, s)
    generator = build_generators({agent_name: agent})[agent_name]
    problems = _problems(task, part, seed, s.get("test_limit"))
    sandbox, grader = _grader(task)
    prompts, n, chunk = PromptBuilder(), s["test_samples"], 16
    rows = []
    try:
        full = metric_view(grader)
        for index in range(0, len(problems), chunk):
            part_problems = problems[index : index + chunk]
            torch.manual_seed(sampling_seed(seed, f"{stream}/{agent_name}", index // chunk))
            chats = [prompts.fresh_messages(p) for p in part_problems for _ in range(n)]
            completions = generator.generate(chats)
            owners = [p for p in part_problems for _ in range(n)]
            grades = full.grade([(p, c.text) for p, c in zip(owners, completions, strict=True)])
            for i, problem in enumerate(part_problems):
                mine = grades[i * n : (i + 1) * n]
                texts = [g.code for g in mine]
                public = [g.public_pass_rate == 1.0 for g in mine]
                passed = [bool(g.private_passed) for g in mine]
                first = next((j for j in range(n) if public[j]), 0)
                pool = [j for j in range(n) if public[j]] or list(range(n))
                votes = Counter(_vote_key(texts[j]) for j in pool)
                top = votes.most_common(1)[0][0]
                voted = next(j for j in pool if _vote_key(texts[j]) == top)
                rows.append({"id": problem.id, "group": problem.metadata["group"],
                             "correct": sum(passed), "n": n, "public_first": passed[first],
                             "vote": passed[voted],
                             # per sample, for flat selections over several agents' samples:
                             "public": "".join("01"[x] for x in public),
                             "passed": "".join("01"[x] for x in passed),
                             "programs": [_short(texts[j]) for j in range(n)]})  # fmt: skip
    finally:
        sandbox.close()
    return {"rows": rows, **_summarise_rows(rows), **_cost(wall, cpu, children)}


def _summarise_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def block(selected: list[dict[str, Any]]) -> dict[str, float]:
        return {
            "pass@1": statistics.fmean(r["correct"] / r["n"] for r in selected),
            "flat_public": statistics.fmean(float(r["public_first"]) for r in selected),
            "flat_vote": statistics.fmean(float(r["vote"]) for r in selected),
        }

    groups = sorted({r["group"] for r in rows})
    return {**block(rows), "groups": {g: block([r for r in rows if r["group"] == g])
                                      for g in groups}}  # fmt: skip


def tree_job(task: dict[str, Any], s: dict[str, Any], weights: dict[str, str], seed: int,
             stream: str, part: str) -> dict[str, Any]:  # fmt: skip
    """One evaluation tree per test problem holding the given agents (name -> weights): the
    `stack` search with Thompson-sampled agents at ``eval_nodes`` nodes, searched on public tests,
    judged on all (Pass@1(MCTS), Pass@N), with each agent's own-node count."""
    from mars2.eval.runner import ResultStore, evaluate_tree, summarise_tree
    from mars2.generation.factory import build_generators
    from mars2.search.runner import SearchConfig

    wall, cpu = time.perf_counter(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    agents = {name: _agent(name, path, s) for name, path in weights.items()}
    generators = build_generators(agents)
    problems = _problems(task, part, seed, s.get("test_limit"))
    sandbox, grader = _grader(task)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = ResultStore(f"{tmp}/tree.jsonl")
            evaluate_tree(problems, generators, grader, SearchConfig(max_nodes=s["eval_nodes"]),
                          store, seed, stream=stream)  # fmt: skip
            rows = [store.rows[p.id] for p in problems]
    finally:
        sandbox.close()
    summary = summarise_tree(stream, rows)
    nodes = {name: sum(r["agents"].get(name, 0) for r in rows) for name in weights}
    return {
        **summary.metrics,
        "groups": {k.removeprefix("difficulty="): v for k, v in summary.breakdown.items()
                   if k.startswith("difficulty=")},
        "nodes": nodes,
        **_cost(wall, cpu, children),
    }  # fmt: skip
