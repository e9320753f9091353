"""Evaluation never peeks at private tests; metric verdicts use public and private tests together.

Graded through the real local sandbox. The generator is scripted (it answers with fixed code and
records every prompt it is shown), standing in for a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mars2.data.problem import Problem, TestCase, TestKind
from mars2.eval.runner import ResultStore, evaluate_sampling, evaluate_tree, summarise_tree
from mars2.generation.base import Completion, Messages
from mars2.sandbox.base import Verdict
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.records import Grade, TestFeedback
from mars2.sandbox.verdict.grader import Grader
from mars2.search.policy import PolicyConfig
from mars2.search.prompts import PromptBuilder
from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.tree import Node

# Passes both public tests, fails the private one (negative numbers) -- and prints "PRIVATE-ONLY"
# nowhere: the private test's input and output are distinctive strings to look for in prompts.
OVERFIT = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"
CORRECT = "a, b = map(int, input().split())\nprint(a + b)\n"
PRIVATE = TestCase("-31337 -4242", "-35579")


def _problem(profile: str = "lcb") -> Problem:
    return Problem(
        id="sum-of-two",
        statement="Read two integers a and b and print a + b.",
        test_kind=TestKind.STDIN,
        public_tests=(TestCase("1 2", "3"), TestCase("10 20", "30")),
        private_tests=(TestCase("5 6", "11"), PRIVATE),
        metadata={"grading_profile": profile},
    )


class Scripted:
    """Answers every prompt with `code`, and keeps the prompts it was shown."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.seen: list[Messages] = []

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        self.seen.extend(chats)
        return [Completion(text=f"```python\n{self.code}```", token_ids=[1]) for _ in chats]


def _prompt_text(chats: list[Messages]) -> str:
    return "\n".join(m["content"] for chat in chats for m in chat)


def test_public_view_never_runs_private_tests(sandbox: LocalSandbox) -> None:
    problem = _problem()
    full = Grader(sandbox)
    (seen,) = full.public_view().grade_code([(problem, OVERFIT)])
    assert seen.reward == 1.0 and seen.private_passed
    assert seen.private == []  # not run at all
    assert [t.verdict for t in seen.public] == [Verdict.PASSED, Verdict.PASSED]
    (truth,) = full.grade_code([(problem, OVERFIT)])
    assert truth.reward == 0.0 and not truth.private_passed
    assert [t.verdict for t in truth.private] == [Verdict.PASSED, Verdict.WRONG_ANSWER]


def test_eval_search_uses_public_reward_and_final_metric_uses_all_tests(
    sandbox: LocalSandbox, tmp_path
) -> None:
    problem = _problem()
    generator = Scripted(OVERFIT)
    # refine_solved: the public-solved node is refined anyway, so a refine prompt is produced.
    config = SearchConfig(
        max_nodes=4, expansions_per_round=2, policy=PolicyConfig(refine_solved=True)
    )
    store = ResultStore(tmp_path / "tree.jsonl")
    trees_dir = tmp_path / "trees"
    evaluate_tree([problem], {"a": generator}, Grader(sandbox), config, store, 0, trees_dir)

    from mars2.search.tree import load_trees

    (tree,) = load_trees(next(trees_dir.glob("*.jsonl")))
    answers = list(tree.answers())
    assert len(answers) == 4
    # During the search every node carries the public reward (1.0), not the private one (0.0).
    assert all(n.reward == 1.0 and n.public_pass_rate == 1.0 for n in answers)
    assert all(n.private_passed for n in answers)  # "solved" as far as the search can know
    # Refine prompts were built (children of answers) and say nothing about private tests.
    refinements = [n for n in answers if n.parent != 0]
    assert refinements, "the search should have refined a node"
    text = _prompt_text(generator.seen)
    for secret in (PRIVATE.input, PRIVATE.output, "5 6", "11", "hidden", "private"):
        assert secret not in text
    # The metric judges on public + private: the answer fails, so both metrics count 0.
    row = store.rows[problem.id]
    assert row["search_solved"] is True
    assert row["mcts_pass"] is False and row["any_pass"] is False
    summary = summarise_tree("t", list(store.rows.values()))
    assert summary.metrics == {"pass@1(mcts)": 0.0, "pass@N": 0.0}


def test_eval_metrics_count_a_correct_answer(sandbox: LocalSandbox, tmp_path) -> None:
    problem = _problem()
    store = ResultStore(tmp_path / "tree.jsonl")
    config = SearchConfig(max_nodes=2, expansions_per_round=2)
    evaluate_tree([problem], {"a": Scripted(CORRECT)}, Grader(sandbox), config, store, 0)
    assert store.rows[problem.id]["mcts_pass"] is True
    assert store.rows[problem.id]["any_pass"] is True
    sampling = ResultStore(tmp_path / "sampling.jsonl")
    evaluate_sampling([problem], Scripted(OVERFIT), Grader(sandbox), 2, sampling)
    assert sampling.rows[problem.id]["correct"] == 0
    again = ResultStore(tmp_path / "sampling2.jsonl")
    evaluate_sampling([problem], Scripted(CORRECT), Grader(sandbox), 2, again)
    assert again.rows[problem.id]["correct"] == 2


def test_metrics_judge_on_all_tests_even_with_a_public_only_grader(
    sandbox: LocalSandbox, tmp_path
) -> None:
    # The training callback hands the run's grader over, which may reward public tests only.
    public = Grader(sandbox, reward_tests="public")
    store = ResultStore(tmp_path / "x")
    evaluate_sampling([_problem()], Scripted(OVERFIT), public, 2, store)
    assert store.rows["sum-of-two"]["correct"] == 0
    assert public.full_view().reward_tests == "all" and public.reward_tests == "public"


def test_training_reward_tests_all_and_public(sandbox: LocalSandbox) -> None:
    problem = _problem("lenient")
    (all_tests,) = Grader(sandbox, reward="pass_rate").grade_code([(problem, OVERFIT)])
    assert all_tests.reward == pytest.approx(3 / 4)  # 2 public + 1 of 2 private
    (public,) = Grader(sandbox, reward="pass_rate", reward_tests="public").grade_code(
        [(problem, OVERFIT)]
    )
    assert public.reward == 1.0
    with pytest.raises(ValueError, match="reward_tests"):
        Grader(sandbox, reward_tests="private")  # type: ignore[arg-type]


def test_refine_prompt_is_the_same_whatever_the_private_tests_say() -> None:
    problem = _problem()
    prompts = PromptBuilder()
    public = [
        TestFeedback(Verdict.PASSED, t.input, t.output, t.output, "") for t in problem.public_tests
    ]
    private_fail = [TestFeedback(Verdict.WRONG_ANSWER, "9 9", "18", "0", "")]
    private_pass = [TestFeedback(Verdict.PASSED, "9 9", "18", "18", "")]
    failed_private = Node(
        1, 0, 1, agent="a", grade=Grade(OVERFIT, public, private_fail, 0.0), reward=0.0
    )
    passed_private = Node(
        2, 0, 1, agent="a", grade=Grade(OVERFIT, public, private_pass, 1.0), reward=1.0
    )
    one = prompts.refine_messages(problem, failed_private)
    two = prompts.refine_messages(problem, passed_private)
    assert one == two
    assert "hidden" not in _prompt_text([one]).lower()


def test_search_with_public_view_keeps_refining_until_public_solved(
    sandbox: LocalSandbox,
) -> None:
    # Without refine_solved the search stops widening a node once it passes every public test --
    # the gate reads public verdicts only, so an answer failing a private test is not pursued.
    problem = _problem()
    search = TreeSearch(SearchConfig(max_nodes=3, expansions_per_round=1))
    import numpy as np

    (tree,) = search.grow(
        [problem], {"a": Scripted(OVERFIT)}, Grader(sandbox).public_view(), np.random.default_rng(0)
    )
    assert all(n.parent == 0 for n in tree.answers())
