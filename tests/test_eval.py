"""Evaluation: pass@k against brute force, oracle runs on HumanEval, resumability, tree pages."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mars2.data.humaneval import load_humaneval
from mars2.data.toy import toy_problems
from mars2.eval.passk import pass_at_k
from mars2.eval.run import answer_key
from mars2.eval.runner import (
    ResultStore,
    best_public_node,
    evaluate_sampling,
    evaluate_tree,
    summarise_sampling,
    summarise_tree,
)
from mars2.eval.tree_view import plot_training_overview, render_tree_html, write_tree_pages
from mars2.generation.reference import ReferenceGenerator, reference_solution
from mars2.sandbox.base import Verdict
from mars2.sandbox.records import Grade, TestFeedback
from mars2.sandbox.verdict.grader import Grader
from mars2.search.runner import SearchConfig
from mars2.search.simulation.environment import SimulatedAgent, SimulatedGrader, simulated_problems
from mars2.search.tree import SearchTree

REPO = Path(__file__).resolve().parents[1]
PASS, FAIL = Verdict.PASSED, Verdict.WRONG_ANSWER


def _feedback(verdict: Verdict) -> TestFeedback:
    return TestFeedback(verdict, "", "", "", "")


def _grade(public: list[Verdict], private: list[Verdict]) -> Grade:
    """A grade with these public and private test verdicts."""
    return Grade(
        code="pass",
        public=[_feedback(v) for v in public],
        private=[_feedback(v) for v in private],
    )


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@given(n=st.integers(1, 9), data=st.data())
def test_pass_at_k_matches_brute_force(n: int, data) -> None:
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k))


class _Flaky(ReferenceGenerator):
    """Right on every other call per problem: known, nonzero pass counts."""

    def __init__(self, problems) -> None:
        self.calls: dict[str, int] = {}
        super().__init__(answer_key(problems))

    def answer(self, problem_id: str) -> str:
        count = self.calls[problem_id] = self.calls.get(problem_id, 0) + 1
        return (
            super().answer(problem_id)
            if count % 2 == 1 or problem_id.endswith("0")
            else "def nothing(): pass"
        )


class _Broken(ReferenceGenerator):
    """Answers every problem with its bare prompt: a function that returns None."""

    def __init__(self, problems) -> None:
        super().__init__(answer_key(problems))
        self.statements = {p.id: p.statement for p in problems}

    def answer(self, problem_id: str) -> str:
        return self.statements[problem_id] + "    return None\n"


def test_sampling_summary_matches_brute_force_counts(sandbox, tmp_path: Path) -> None:
    problems = load_humaneval()[:6]
    store = ResultStore(tmp_path / "s.jsonl")
    evaluate_sampling(problems, _Flaky(problems), Grader(sandbox), samples=3, store=store)
    rows = list(store.rows.values())
    assert [r["correct"] for r in rows] == [3, 2, 2, 2, 2, 2]
    summary = summarise_sampling("flaky", rows)
    for k in (1, 2, 3):
        expected = np.mean([brute_force_pass_at_k(r["n"], r["correct"], k) for r in rows])
        assert summary.metrics[f"pass@{k}"] == pytest.approx(expected)
    assert summary.breakdown["platform=humaneval"]["problems"] == 6


@pytest.mark.slow
def test_oracle_scores_one_and_broken_scores_zero_on_humaneval(tmp_path: Path) -> None:
    from mars2.sandbox.pool.local import LocalSandbox

    problems = load_humaneval()
    with LocalSandbox(per_test_timeout=3.0, job_timeout=10.0) as box:
        grader = Grader(box)
        good, bad = ResultStore(tmp_path / "good.jsonl"), ResultStore(tmp_path / "bad.jsonl")
        evaluate_sampling(problems, ReferenceGenerator(answer_key(problems)), grader, 1, good)
        evaluate_sampling(problems, _Broken(problems), grader, 1, bad)
    assert summarise_sampling("oracle", list(good.rows.values())).metrics["pass@1"] == 1.0
    assert summarise_sampling("broken", list(bad.rows.values())).metrics["pass@1"] == 0.0


class _Counting(ReferenceGenerator):
    def __init__(self, problems) -> None:
        super().__init__(answer_key(problems))
        self.prompts = 0

    def generate(self, chats):
        self.prompts += len(chats)
        return super().generate(chats)


def test_interrupted_eval_resumes_without_regrading(sandbox, tmp_path: Path) -> None:
    problems = toy_problems()[:6]
    path = tmp_path / "r.jsonl"
    first = _Counting(problems)
    evaluate_sampling(
        problems[:4], first, Grader(sandbox), 2, ResultStore(path), chunk=2
    )  # "interrupted" after two whole chunks
    again = _Counting(problems)
    store = ResultStore(path)
    evaluate_sampling(problems, again, Grader(sandbox), 2, store, chunk=2)
    assert first.prompts == 8 and again.prompts == 4  # only the 2 unfinished problems
    assert len(store.rows) == 6 and len(path.read_text().splitlines()) == 6


def test_mcts_answer_is_best_public_latest_on_ties() -> None:
    tree = SearchTree.new(simulated_problems(1)[0])
    tree.add(0, agent="a", grade=_grade(public=[PASS, FAIL], private=[FAIL]))  # 0.5, failed
    tree.add(0, agent="a", grade=_grade(public=[PASS, PASS], private=[FAIL]))  # 1.0, failed
    tree.add(1, agent="b", grade=_grade(public=[PASS, PASS], private=[PASS]))  # 1.0, passed
    chosen = best_public_node(tree)
    assert chosen is not None and chosen.id == 3


def test_tree_eval_metrics_on_the_simulator(tmp_path: Path) -> None:
    problems = simulated_problems(40)
    store = ResultStore(tmp_path / "t.jsonl")
    team = {"a": SimulatedAgent(0.3, seed=1), "b": SimulatedAgent(0.1, seed=2)}
    evaluate_tree(
        problems, team, SimulatedGrader(), SearchConfig(max_nodes=6), store, 0, tmp_path / "trees"
    )
    summary = summarise_tree("team", list(store.rows.values()))
    rows = list(store.rows.values())
    assert summary.metrics["pass@N"] == pytest.approx(np.mean([r["any_pass"] for r in rows]))
    assert summary.metrics["pass@1(mcts)"] <= summary.metrics["pass@N"]
    assert all(r["nodes"] == 6 or r["any_pass"] for r in rows)
    assert list((tmp_path / "trees").glob("*.jsonl"))


def _small_tree() -> SearchTree:
    problem = toy_problems()[0]
    tree = SearchTree.new(problem)
    failing = TestFeedback(Verdict.WRONG_ANSWER, "1 2", "3", "0", "")
    tree.add(0, agent="tiny_qwen3", reward=0.0, messages=[{"role": "user", "content": problem.statement}],
             grade=Grade(code="print(0)\n", public=[failing]))  # fmt: skip
    tree.add(
        1, agent="tiny_llama", reward=1.0,
        grade=Grade(code=reference_solution(problem), private=[_feedback(PASS)], reward=1.0),
    )  # fmt: skip
    tree.add(0, agent="tiny_llama", reward=0.0, grade=Grade(code=None))
    return tree


def test_tree_page_is_self_contained_and_lists_every_node(tmp_path: Path) -> None:
    page = render_tree_html(_small_tree())
    assert page.count('class="node"') == 4  # root + 3 answers
    assert "tiny_qwen3" in page and "tiny_llama" in page and "wrong_answer" in page
    assert not re.search(r'(src|href)="', page)  # no external assets: scripts and styles are inline
    paths = write_tree_pages([_small_tree()], tmp_path)
    assert paths[0].read_text() == page


def test_tree_page_opens_on_the_best_node_and_scales_to_fit() -> None:
    problem = toy_problems()[0]
    tree = SearchTree.new(problem)
    for index in range(16):  # 16 depth-1 nodes: a fixed-size SVG overflowed the left half
        passing = index == 11
        tree.add(0, agent="tiny_qwen3" if index % 2 else "tiny_llama", reward=float(passing),
                 grade=Grade(code="print(1)", public=[_feedback(PASS if passing else FAIL)]))  # fmt: skip
    page = render_tree_html(tree)
    svg = re.search(r"<svg [^>]*>", page)
    assert svg is not None and 'width="100%"' in svg.group(0) and "viewBox=" in svg.group(0)
    assert not re.search(r'<svg[^>]* width="\d+"', page)  # no fixed pixel width
    assert 'show("12");' in page  # node 12 (the 12th answer) is the one that passes
    assert page.count("stroke-dasharray") == 1  # and it is marked


def test_training_overview_steps_are_whole_numbers() -> None:
    from mars2.eval.tree_view import overview_figure

    figure = overview_figure({0: [_small_tree()], 1: [_small_tree()], 2: [_small_tree()]})
    for axis in figure.axes:
        ticks = axis.get_xticks()
        assert len(ticks) and all(float(t).is_integer() for t in ticks), ticks


def test_training_overview_plot(tmp_path: Path) -> None:
    out = plot_training_overview(
        {0: [_small_tree()], 1: [_small_tree()]}, tmp_path / "overview.png"
    )
    assert out.stat().st_size > 5000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Chromium is not installed (.ci/run installs it)"
)
def test_tree_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    from PIL import Image

    from mars2.search.tree import save_trees

    trees_file = tmp_path / "trees.jsonl"
    save_trees([_small_tree()], trees_file)
    png = tmp_path / "tree.png"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/view_tree.py"), str(trees_file), "--screenshot", str(png), "--no-open"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    image = Image.open(png).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20) or []
    greenish = sum(
        count for count, (r, g, b) in colours if g > 150 and r < 100
    )  # the solved node's fill
    assert image.size == (1400, 900) and len(colours) > 50 and greenish > 200


@pytest.mark.slow
def test_eval_cli_end_to_end_on_humaneval_with_tiny_models(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MARS2_TINY_MODELS": str(tiny_models_dir)}
    command = [
        sys.executable, "-m", "mars2.cli.eval", "experiment=tiny_pair", "data=humaneval",
        "eval.limit=2", "eval.samples=2", "eval.tree_budget=3", "eval.allow_untrained=true",
        f"hydra.run.dir={tmp_path}",
        f"paths.log_dir={tmp_path}/logs", "agents.tiny_qwen3.generation.max_new_tokens=24",
        "agents.tiny_llama.generation.max_new_tokens=24",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = {
        s["name"]: s for s in json.loads((tmp_path / "results.json").read_text())["settings"]
    }
    assert set(summaries) == {
        "tiny_qwen3",
        "tiny_qwen3+tree",
        "tiny_llama",
        "tiny_llama+tree",
        "team+tree",
    }
    for name in ("tiny_qwen3", "tiny_llama"):
        rows = [
            json.loads(x)
            for x in (tmp_path / "results" / f"{name}_sampling.jsonl").read_text().splitlines()
        ]
        for k in (1, 2):
            expected = np.mean([brute_force_pass_at_k(r["n"], r["correct"], k) for r in rows])
            assert summaries[name]["metrics"][f"pass@{k}"] == pytest.approx(expected)
    assert "pass@1" in result.stdout and "team+tree" in result.stdout
    assert (tmp_path / "results.csv").exists() and list((tmp_path / "tree_pages").glob("*.html"))


# --- reproducible, resumable evaluation with the tiny agents -------------------------------------


def _tiny_generators(tiny_models_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mars2.generation.transformers_backend import TransformersGenerator

    generators = {}
    for name in ("tiny_qwen3", "tiny_llama"):
        path = tiny_models_dir / name
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        generators[name] = TransformersGenerator(model, AutoTokenizer.from_pretrained(path), 12)
    return generators


class _DiesAfter:
    """A grader that works `calls` times and then fails, as a killed run stops."""

    def __init__(self, grader: Grader, calls: int) -> None:
        self.grader, self.calls = grader, calls

    def grade(self, items):
        if self.calls == 0:
            raise KeyboardInterrupt("killed")
        self.calls -= 1
        return self.grader.grade(items)


def _eval_files(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*.jsonl"))}


@pytest.mark.slow
def test_tiny_eval_twice_same_numbers_and_killed_eval_resumes_exactly(
    sandbox, tmp_path: Path, tiny_models_dir: Path
) -> None:
    from mars2.eval.runner import evaluate_settings

    problems = toy_problems()[:4]
    generators = _tiny_generators(tiny_models_dir)
    config = SearchConfig(max_nodes=3, expansions_per_round=2)

    def run(out: Path, grader) -> list:
        return evaluate_settings(problems, generators, grader, config, 2, out, seed=7, chunk=2,
                                 progress=False)  # fmt: skip

    first = run(tmp_path / "a", Grader(sandbox))
    torch.rand(7)  # the global RNG moves on between the runs: only reseeding gives equal draws
    second = run(tmp_path / "b", Grader(sandbox))
    assert [s.metrics for s in first] == [s.metrics for s in second]
    assert _eval_files(tmp_path / "a") == _eval_files(tmp_path / "b")
    trees = sorted((tmp_path / "a" / "trees").rglob("*.jsonl"))
    assert len(trees) == 3 * len(problems)  # one file per problem and setting (2 agents + team)

    # Killed in the middle of the tree phase (after 2 sampling chunks x 2 agents + 3 rounds)...
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "c", _DiesAfter(Grader(sandbox), 7))
    partial = _eval_files(tmp_path / "c")
    assert partial and len(partial) < len(_eval_files(tmp_path / "a"))
    # ...and resumed: every file of the uninterrupted run, byte for byte, and its numbers.
    resumed = run(tmp_path / "c", Grader(sandbox))
    assert [s.metrics for s in resumed] == [s.metrics for s in first]
    assert _eval_files(tmp_path / "c") == _eval_files(tmp_path / "a")
    final = _eval_files(tmp_path / "c")
    for name, text in partial.items():  # nothing finished before the kill was lost or changed
        assert final[name] == text if name.startswith("trees") else final[name].startswith(text)


class _OneSkill(ReferenceGenerator):
    """Solves the problems of one group of the two-skill task and nothing else."""

    def __init__(self, problems, group: str) -> None:
        super().__init__(answer_key(problems))
        self.solves = {p.id for p in problems if p.metadata["group"] == group}

    def answer(self, problem_id: str) -> str:
        return super().answer(problem_id) if problem_id in self.solves else "print(0)"

    def catch_up(self) -> bool:  # the callbacks bring a trained agent's generator up to date
        return False


class _Coin(_OneSkill):
    """Right on any problem with probability 1/2, drawn from torch's generator."""

    def generate(self, chats):
        out = super().generate(chats)
        return [c if torch.rand(()) < 0.5 else type(c)(text="print(0)") for c in out]


def _stand_ins(grader, generators):
    """The trainer and team a callback reads: the run's grader and each agent's generator."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(engine=SimpleNamespace(grader=grader)), logger=None
    )
    members = {name: SimpleNamespace(generator=g) for name, g in generators.items()}
    return trainer, SimpleNamespace(agents=members)


def _skill_sample():
    from mars2.data.sources import skills

    held = skills("held_out")
    return [p for g in ("add", "mul", "composition") for p in held if p.metadata["group"] == g][::4]


def test_held_out_callback_reports_groups_and_seeded_repeats(sandbox) -> None:
    from mars2.eval.callbacks import HeldOutEvalCallback

    problems = _skill_sample()
    share = sum(p.metadata["group"] == "add" for p in problems) / len(problems)
    trainer, team = _stand_ins(Grader(sandbox), {"adder": _OneSkill(problems, "add")})
    callback = HeldOutEvalCallback(problems, samples=2, seed=7)
    callback._evaluate(trainer, team, 0)
    assert callback.history == [(0, "adder", pytest.approx(share))]
    assert callback.groups == [(0, "adder", {"add": 1.0, "composition": 0.0, "mul": 0.0})]
    # Seeded: the same weights score the same at every evaluation, in every run.
    trainer, team = _stand_ins(Grader(sandbox), {"coin": _Coin(problems, "add")})
    seeded = HeldOutEvalCallback(problems, samples=2, seed=7)
    for step in (0, 5):
        seeded._evaluate(trainer, team, step)
    assert seeded.history[0][2] == seeded.history[1][2]
    assert 0.0 < seeded.history[0][2] < share  # the coin is right on about half of "add"


class _MustNotSample(_OneSkill):
    def generate(self, chats):
        raise AssertionError("sampled although the step-0 result was cached")


def test_held_out_callback_reuses_a_cached_step_zero(sandbox, tmp_path) -> None:
    from mars2.eval.callbacks import HeldOutEvalCallback

    problems = _skill_sample()
    trainer, team = _stand_ins(Grader(sandbox), {"coin": _Coin(problems, "add")})
    first = HeldOutEvalCallback(problems, samples=2, seed=7, start_cache=tmp_path / "start")
    first._evaluate(trainer, team, 0)
    assert (tmp_path / "start" / "heldout_step0_coin.json").is_file()  # the folder is made
    # A later run from the same start reads the result instead of sampling, exactly.
    trainer, team = _stand_ins(Grader(sandbox), {"coin": _MustNotSample(problems, "add")})
    second = HeldOutEvalCallback(problems, samples=2, seed=7, start_cache=tmp_path / "start")
    second._evaluate(trainer, team, 0)
    assert second.history == first.history and second.groups == first.groups
    with pytest.raises(AssertionError, match="sampled"):  # only step 0 is kept
        second._evaluate(trainer, team, 5)
    with pytest.raises(ValueError, match="needs a seed"):
        HeldOutEvalCallback(problems, start_cache=tmp_path)


def test_tree_callback_scores_each_agent_and_the_team(sandbox) -> None:
    from mars2.eval.callbacks import TreeEvalCallback

    problems = _skill_sample()
    share = {
        g: sum(p.metadata["group"] == g for p in problems) / len(problems) for g in ("add", "mul")
    }
    generators = {"adder": _OneSkill(problems, "add"), "multiplier": _OneSkill(problems, "mul")}
    trainer, team = _stand_ins(Grader(sandbox), generators)
    callback = TreeEvalCallback(problems, SearchConfig(max_nodes=6), seed=0)
    callback.on_train_end(trainer, team)  # type: ignore[arg-type]
    results = callback.results
    assert set(results) == {"adder", "multiplier", "team"}
    assert results["adder"]["pass@N"] == pytest.approx(share["add"])
    assert results["multiplier"]["pass@1(mcts)"] == pytest.approx(share["mul"])
    # Complementary agents: the shared tree covers both halves, and no one solves compositions.
    assert results["team"]["pass@N"] == pytest.approx(share["add"] + share["mul"])
    assert results["team"]["pass@1(mcts)"] == pytest.approx(share["add"] + share["mul"])
    assert results["team"]["composition"]["pass@N"] == 0.0
    assert results["adder"]["mul"]["pass@N"] == 0.0
