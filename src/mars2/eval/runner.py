"""Evaluation runs: Pass@k from independent samples, Pass@1(MCTS) and Pass@N from grown trees.

The search never sees a private test: its rewards, its refine gate and its refine prompts come from
a grader that runs the public tests only. Every metric's verdict comes from the full grader (public
and private tests, as LiveCodeBench grades), applied to the answers once they exist.

Problems run in fixed chunks (trees of a chunk grow together, a round of expansions at a time);
each chunk is seeded from the config's seed, the setting and the chunk's index alone. Results are
kept per problem id in a jsonl file and trees in one file per problem, both written atomically as
each chunk finishes, so an interrupted run continues with the first unfinished chunk and ends with
exactly the numbers and trees of an uninterrupted run.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from mars2.data.problem import Problem
from mars2.eval.passk import pass_at_k
from mars2.search.core import GraderLike
from mars2.search.prompts import PromptBuilder
from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.tree import Node, SearchTree, save_trees
from mars2.utils.atomic import atomic_write_text


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
        by_text.setdefault(node.completion.text, []).append(node.id)
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
    """Per-problem results of one evaluation, keyed by problem id, in a jsonl file that survives
    interruption (rewritten atomically, so a kill never leaves a torn line)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.rows: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a torn last line of an older, non-atomic writer
                    continue
                self.rows[row["problem_id"]] = row

    def done(self, problem_id: str) -> bool:
        return problem_id in self.rows

    def add(self, row: dict[str, Any]) -> None:
        self.add_many([row])

    def add_many(self, rows: Sequence[dict[str, Any]]) -> None:
        for row in rows:
            self.rows[row["problem_id"]] = row
        text = "".join(json.dumps(r) + "\n" for r in self.rows.values())
        atomic_write_text(self.path, text)


def _metadata(problem: Problem) -> dict[str, Any]:
    return {
        "problem_id": problem.id,
        "difficulty": str(problem.metadata.get("difficulty") or "unknown"),
        "platform": str(
            problem.metadata.get("platform") or problem.metadata.get("source") or "unknown"
        ),
    }


def tree_file(folder: str | Path, problem_id: str) -> Path:
    """The file holding one problem's tree: named by its id, so every problem keeps its own."""
    return Path(folder) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', problem_id)}.jsonl"


def chunk_seed(seed: int, stream: str, index: int) -> list[int]:
    """Seed material for chunk `index` of `stream` (e.g. ``sampling/<agent>``): a function of the
    config's seed and the chunk's place in the problem list only, never of what ran before."""
    return [int(seed), zlib.crc32(stream.encode("utf-8")), int(index)]


def _seed_torch(material: list[int]) -> None:
    torch.manual_seed(int(np.random.SeedSequence(material).generate_state(1)[0]))


def _chunks(problems: Sequence[Problem], size: int | None) -> list[list[Problem]]:
    step = size if size and size > 0 else max(1, len(problems))
    return [list(problems[i : i + step]) for i in range(0, len(problems), step)]


def _bar(total: int, done: int, desc: str, show: bool) -> Any:
    return tqdm(
        total=total, initial=done, desc=desc, unit="problem", disable=not show, dynamic_ncols=True
    )


def _unfinished_chunks(
    problems: Sequence[Problem], chunk: int | None, store: ResultStore, desc: str, show: bool
) -> Iterator[tuple[int, list[Problem], Callable[[list[dict[str, Any]]], None]]]:
    """Each chunk not yet finished in `store`, with its index (the seed material) and the function
    that stores its rows and advances the progress bar."""
    with _bar(len(problems), sum(store.done(p.id) for p in problems), desc, show) as bar:
        for index, part in enumerate(_chunks(problems, chunk)):
            if all(store.done(p.id) for p in part):
                continue

            def finish(rows: list[dict[str, Any]], part: list[Problem] = part) -> None:
                new = sum(not store.done(p.id) for p in part)
                store.add_many(rows)
                bar.update(new)

            yield index, part, finish


def evaluate_sampling(
    problems: Sequence[Problem],
    generator: Any,
    grader: GraderLike,
    samples: int,
    store: ResultStore,
    prompts: PromptBuilder | None = None,
    chunk: int = 16,
    on_progress: Callable[[int, int], None] | None = None,
    seed: int | None = None,
    stream: str = "sampling",
    progress: bool = False,
) -> None:
    """n independent samples per problem; stores how many pass all tests (public + private).

    Problems go in fixed chunks of `chunk` (by position in `problems`). With `seed`, each chunk's
    sampling is seeded from (seed, stream, chunk index), so a rerun, or a resumed run that redoes
    an unfinished chunk, draws exactly the same samples. Finished chunks are skipped.
    """
    grader = metric_view(grader)
    prompts = prompts or PromptBuilder()
    for index, part, finish in _unfinished_chunks(problems, chunk, store, stream, progress):
        if seed is not None:
            _seed_torch(chunk_seed(seed, stream, index))
        chats = [prompts.fresh_messages(p) for p in part for _ in range(samples)]
        completions = generator.generate(chats)
        owners = [p for p in part for _ in range(samples)]
        grades = grader.grade([(p, c.text) for p, c in zip(owners, completions, strict=True)])
        rows = []
        for i, problem in enumerate(part):
            mine = grades[i * samples : (i + 1) * samples]
            correct = sum(g.private_passed for g in mine)
            rows.append({**_metadata(problem), "n": samples, "correct": correct})
        finish(rows)
        if on_progress:
            finished = sum(store.done(p.id) for p in problems)
            on_progress(finished, len(problems))


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
    stream: str = "tree",
    progress: bool = False,
    search_grader: GraderLike | None = None,
) -> None:
    """Grow trees for a chunk of problems at once, in rounds, on public tests only; then judge their
    answers on all tests. Stores whether the best-public node passes (Pass@1(MCTS)) and whether any
    node passes (Pass@N), and each problem's tree under `trees_path/<problem id>.jsonl`.

    `grader`'s full view gives the metric verdicts; the search uses `search_grader`, by default
    `grader`'s public-only view.

    Each chunk's search and sampling are seeded from (rng_seed, stream, chunk index), so a resumed
    run redoing an unfinished chunk grows exactly the trees an uninterrupted run grows.
    """
    search = TreeSearch(config, prompts)
    searcher = search_grader if search_grader is not None else search_view(grader)
    for index, part, finish in _unfinished_chunks(problems, chunk, store, stream, progress):
        material = chunk_seed(rng_seed, stream, index)
        _seed_torch(material)
        trees = search.grow(part, generators, searcher, np.random.default_rng(material))
        if trees_path is not None:
            for tree in trees:
                save_trees([tree], tree_file(trees_path, tree.problem.id))
        rows = []
        for problem, tree in zip(part, trees, strict=True):
            chosen = best_public_node(tree)
            verdicts = final_verdicts(tree, grader)
            agents = {name: sum(n.agent == name for n in tree.answers()) for name in generators}
            rows.append(
                {
                    **_metadata(problem),
                    "mcts_pass": bool(chosen is not None and verdicts[chosen.id]),
                    "any_pass": any(verdicts.values()),
                    "search_solved": tree.solved,
                    "nodes": len(tree),
                    "agents": agents,
                }
            )
        finish(rows)


def evaluate_settings(
    problems: Sequence[Problem],
    generators: Mapping[str, Any],
    grader: GraderLike,
    search_config: SearchConfig,
    samples: int,
    out: str | Path,
    seed: int,
    chunk: int | None = 32,
    progress: bool = True,
) -> list[Summary]:
    """Every agent alone (Pass@k, then a single-agent tree) and the whole team (shared tree).

    Results go to ``out/results/<setting>.jsonl`` and trees to ``out/trees/<setting>/<id>.jsonl``;
    rerunning into the same `out` skips finished chunks and reproduces unfinished ones exactly.
    """
    out = Path(out)
    size = chunk or len(problems)

    def rows(store: ResultStore) -> list[dict[str, Any]]:
        return [store.rows[p.id] for p in problems if p.id in store.rows]  # problem order

    summaries = []
    for name, generator in generators.items():
        store = ResultStore(out / "results" / f"{name}_sampling.jsonl")
        evaluate_sampling(problems, generator, grader, samples, store, chunk=size, seed=seed,
                          stream=f"sampling/{name}", progress=progress)  # fmt: skip
        summaries.append(summarise_sampling(name, rows(store)))
    settings = [(f"{name}+tree", name, {name: g}) for name, g in generators.items()]
    if len(generators) > 1:
        settings.append(("team+tree", "team", dict(generators)))
    for label, folder, team in settings:
        store = ResultStore(out / "results" / f"{folder}_tree.jsonl")
        evaluate_tree(problems, team, grader, search_config, store, seed, out / "trees" / folder,
                      chunk=size, stream=f"tree/{folder}", progress=progress)  # fmt: skip
        summaries.append(summarise_tree(label, rows(store)))
    return summaries


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
