"""Evaluation runs: Pass@k from independent samples, Pass@1(MCTS) and Pass@N from grown trees.

The search never sees a private test: its rewards, its refine gate and its refine prompts come from
a grader that runs the public tests only. Every metric's verdict comes from the full grader (public
and private tests, as LiveCodeBench grades), applied to the answers once they exist.

Results are appended per problem to a jsonl file as they finish, so an interrupted run continues
where it stopped without regrading finished problems.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mars2.data.problem import Problem
from mars2.eval.passk import pass_at_k
from mars2.search.prompts import PromptBuilder
from mars2.search.runner import GraderLike, SearchConfig, TreeSearch
from mars2.search.tree import Node, SearchTree, save_trees


def metric_view(grader: GraderLike) -> GraderLike:
    """What metric verdicts use: the grader on all tests (public + private).

    A grader without views (the simulated one, which has no hidden tests) is used as it is.
    """
    view = getattr(grader, "full_view", None)
    return view() if callable(view) else grader


def search_view(grader: GraderLike) -> GraderLike:
    """What the search may use: the grader's public-tests-only view.

    A grader without one (the simulated grader, which has no hidden tests) is used as it is.
    """
    view = getattr(grader, "public_view", None)
    return view() if callable(view) else grader


def final_verdicts(tree: SearchTree, grader: GraderLike) -> dict[int, bool]:
    """Node id -> passed on the full test set, each distinct completion graded once."""
    grader = metric_view(grader)
    by_text: dict[str, list[int]] = {}
    for node in tree.answers():
        by_text.setdefault(node.completion, []).append(node.id)
    texts = list(by_text)
    grades = grader.grade([(tree.problem, text) for text in texts]) if texts else []
    verdicts: dict[int, bool] = {}
    for text, grade in zip(texts, grades, strict=True):
        for node_id in by_text[text]:
            verdicts[node_id] = grade.private_passed
    return verdicts


def best_public_node(tree: SearchTree) -> Node | None:
    """The answer a tree submits: best public-test pass rate, ties going to the latest node."""
    best: Node | None = None
    for node in tree.answers():
        if best is None or node.public_pass_rate >= best.public_pass_rate:
            best = node
    return best


class ResultStore:
    """Per-problem results of one evaluation, in a jsonl file that survives interruption."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.rows: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.rows[row["problem_id"]] = row

    def done(self, problem_id: str) -> bool:
        return problem_id in self.rows

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["problem_id"]] = row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


def _metadata(problem: Problem) -> dict[str, Any]:
    return {
        "problem_id": problem.id,
        "difficulty": str(problem.metadata.get("difficulty") or "unknown"),
        "platform": str(
            problem.metadata.get("platform") or problem.metadata.get("source") or "unknown"
        ),
    }


def evaluate_sampling(
    problems: Sequence[Problem],
    generator: Any,
    grader: GraderLike,
    samples: int,
    store: ResultStore,
    prompts: PromptBuilder | None = None,
    chunk: int = 16,
    on_progress: Callable[[int, int], None] | None = None,
) -> None:
    """n independent samples per problem; stores how many pass all tests (public + private).

    Whatever tests `grader` rewards on, its full view judges.
    """
    grader = metric_view(grader)
    prompts = prompts or PromptBuilder()
    todo = [p for p in problems if not store.done(p.id)]
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        chats = [prompts.fresh_messages(p) for p in part for _ in range(samples)]
        completions = generator.generate(chats)
        grades = grader.grade(
            [
                (p, c.text)
                for p, c in zip([p for p in part for _ in range(samples)], completions, strict=True)
            ]
        )
        for index, problem in enumerate(part):
            mine = grades[index * samples : (index + 1) * samples]
            store.add(
                {**_metadata(problem), "n": samples, "correct": sum(g.private_passed for g in mine)}
            )
        if on_progress:
            on_progress(len(todo) - len(todo[start + chunk :]), len(todo))


def evaluate_tree(
    problems: Sequence[Problem],
    generators: Mapping[str, Any],
    grader: GraderLike,
    config: SearchConfig,
    store: ResultStore,
    rng_seed: int,
    trees_path: str | Path | None = None,
    prompts: PromptBuilder | None = None,
    chunk: int = 8,
    search_grader: GraderLike | None = None,
) -> None:
    """Grow a tree per problem on public tests only, then judge its answers on all tests.

    `grader`'s full view gives the metric verdicts (all tests); the search uses `search_grader`,
    by default `grader`'s public-only view. Stores whether the best-public node passes
    (Pass@1(MCTS)) and whether any node passes (Pass@N).
    """
    search = TreeSearch(config, prompts)
    searcher = search_grader if search_grader is not None else search_view(grader)
    todo = [p for p in problems if not store.done(p.id)]
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        trees = search.grow(part, generators, searcher, np.random.default_rng([rng_seed, start]))
        if trees_path is not None:
            save_trees(trees, Path(trees_path) / f"trees_{start:05d}.jsonl")
        for problem, tree in zip(part, trees, strict=True):
            chosen = best_public_node(tree)
            verdicts = final_verdicts(tree, grader)
            store.add(
                {
                    **_metadata(problem),
                    "mcts_pass": bool(chosen is not None and verdicts[chosen.id]),
                    "any_pass": any(verdicts.values()),
                    "search_solved": tree.solved,
                    "nodes": len(tree),
                    "agents": {
                        name: sum(n.agent == name for n in tree.answers()) for name in generators
                    },
                }
            )


@dataclass
class Summary:
    """Aggregated numbers of one evaluation, overall and per difficulty / platform."""

    name: str
    metrics: dict[str, float]
    breakdown: dict[str, dict[str, float]]


def summarise_sampling(name: str, rows: Sequence[dict[str, Any]]) -> Summary:
    """Mean unbiased pass@k for k = 1..n, overall and per group."""

    def block(selected: Sequence[dict[str, Any]]) -> dict[str, float]:
        n = min(r["n"] for r in selected)
        return {
            f"pass@{k}": float(np.mean([pass_at_k(r["n"], r["correct"], k) for r in selected]))
            for k in range(1, n + 1)
        }

    return Summary(name, block(rows), _breakdown(rows, block))


def summarise_tree(name: str, rows: Sequence[dict[str, Any]]) -> Summary:
    """Pass@1(MCTS) and Pass@N, overall and per group."""

    def block(selected: Sequence[dict[str, Any]]) -> dict[str, float]:
        return {
            "pass@1(mcts)": float(np.mean([r["mcts_pass"] for r in selected])),
            "pass@N": float(np.mean([r["any_pass"] for r in selected])),
        }

    return Summary(name, block(rows), _breakdown(rows, block))


def _breakdown(
    rows: Sequence[dict[str, Any]], block: Callable[[Sequence[dict[str, Any]]], dict[str, float]]
) -> dict[str, dict[str, float]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[f"difficulty={row['difficulty']}"].append(row)
        groups[f"platform={row['platform']}"].append(row)
    return {
        key: {**block(members), "problems": float(len(members))}
        for key, members in sorted(groups.items())
    }
