"""The learning suite's two-skill task: complementary halves, compositions, disjoint parts."""

from __future__ import annotations

import itertools
import re

import pytest

from mars2.data.skills import OTHER_WARM, PARTS, SKILLS, skill_parts
from mars2.data.sources import skills
from mars2.eval.run import answer_key
from mars2.eval.runner import ResultStore, evaluate_sampling, summarise_sampling
from mars2.generation.reference import ReferenceGenerator
from mars2.sandbox.verdict.grader import Grader

WORDS = {skill: [words for words, _, _ in ops.values()] for skill, ops in SKILLS.items()}


def _operators(problem) -> list[str]:
    expression = problem.metadata["reference_solution"].removeprefix("print(int(input()) ")
    return re.findall(r"//|[-+*]", expression)


def test_parts_are_disjoint_and_deterministic() -> None:
    parts = skill_parts()
    ids = {part: {p.id for p in parts[part]} for part in PARTS}
    for first, second in itertools.combinations(PARTS, 2):
        shared = ids[first] & ids[second]
        if {first, second} == {"warm_start_add", "warm_start_mul"}:
            # Only the glimpses: OTHER_WARM single-operator problems per operator.
            assert len(shared) == OTHER_WARM * sum(len(ops) for ops in SKILLS.values())
        else:
            assert not shared, (first, second)
    statements = [p.statement for part in PARTS for p in parts[part]]
    assert len({p.id for part in PARTS for p in parts[part]}) == len(set(statements))
    assert skill_parts() == parts
    assert skill_parts(seed=1)["held_out"] != parts["held_out"]


def test_warm_starts_are_complementary() -> None:
    parts = skill_parts()
    for skill, other in (("add", "mul"), ("mul", "add")):
        warm = parts[f"warm_start_{skill}"]
        own = [p for p in warm if p.metadata["group"] == skill]
        glimpse = [p for p in warm if p.metadata["group"] != skill]
        # The other skill: OTHER_WARM single-operator problems per operator, no more.
        assert sorted(op for p in glimpse for op in _operators(p)) == sorted(
            op for op in SKILLS[other] for _ in range(OTHER_WARM)
        )
        assert {p.metadata["group"] for p in glimpse} == {other}
        assert len(own) > 10 * len(glimpse)
        assert all(op in SKILLS[skill] for p in own for op in _operators(p))
        # No warm start holds an operator of each skill in one program (a composition).
        assert all(len(p.metadata["skills"]) == 1 for p in warm)
        # The check that ends a warm start measures its own skill only.
        checks = parts[f"warm_check_{skill}"]
        assert checks and {p.metadata["group"] for p in checks} == {skill}
        assert not any(w in p.statement for p in checks for w in WORDS[other])
        # Two-operator problems teach the program shape compositions need.
        assert any(len(_operators(p)) == 2 for p in own)


@pytest.mark.parametrize("part", ["train", "held_out"])
def test_train_and_held_out_mix_both_halves_and_compositions(part: str) -> None:
    problems = skills(part)
    groups = {g: [p for p in problems if p.metadata["group"] == g] for g in ("add", "mul")}
    compositions = [p for p in problems if p.metadata["group"] == "composition"]
    assert len(groups["add"]) == len(groups["mul"]) > 0 and compositions
    for skill, members in groups.items():
        assert all(_operators(p) and set(_operators(p)) <= set(SKILLS[skill]) for p in members)
    for problem in compositions:  # one operator of each skill: neither half alone solves it
        first, second = _operators(problem)
        assert first in SKILLS["mul"] and second in SKILLS["add"]
        assert problem.metadata["skills"] == ["add", "mul"]


def test_tests_agree_with_python_on_the_reference_expression() -> None:
    for part in PARTS:
        for problem in skills(part):
            expression = problem.metadata["reference_solution"].strip()[len("print(") : -1]
            for case in problem.public_tests + problem.private_tests:
                value = eval(expression.replace("int(input())", f"({case.input})"))
                assert case.output == str(value), problem.id


def test_reference_solutions_pass_in_the_sandbox(sandbox, tmp_path) -> None:
    problems = skills("held_out")
    store = ResultStore(tmp_path / "oracle.jsonl")
    evaluate_sampling(problems, ReferenceGenerator(answer_key(problems)), Grader(sandbox), 1, store)
    assert summarise_sampling("oracle", list(store.rows.values())).metrics["pass@1"] == 1.0


def test_unknown_part_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown skills part 'warm_start'"):
        skills("warm_start")


def test_study_layout_splits_differ_between_seeds_and_stay_disjoint() -> None:
    from mars2.data.skills import STUDY_PARTS, skill_parts

    def ids(parts: dict, names: tuple[str, ...]) -> dict[str, set[str]]:
        return {name: {p.id for p in parts[name]} for name in names}

    one, two = skill_parts(1000, layout="study"), skill_parts(1001, layout="study")
    assert set(one) == set(STUDY_PARTS)
    assert len(one["test"]) == 144 and len(one["validation"]) == 32
    for name in ("train", "validation", "test", "warm_start_add", "warm_check_mul"):
        assert ids(one, (name,))[name] != ids(two, (name,))[name], name  # a fresh draw per seed
    for parts in (one, two):
        alone = ids(parts, ("train", "validation", "test", "warm_check_add", "warm_check_mul"))
        warm = ids(parts, ("warm_start_add", "warm_start_mul"))
        names = list(alone)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                assert not alone[a] & alone[b], (a, b)
            assert not alone[a] & (warm["warm_start_add"] | warm["warm_start_mul"]), a
        # Only the glimpse problems (2 per operator, 4 operators) sit in both warm starts.
        assert len(warm["warm_start_add"] & warm["warm_start_mul"]) == 8
    # The same seed draws the same split; warm starts and checks match the suite layout.
    again = skill_parts(1000, layout="study")
    assert ids(again, STUDY_PARTS) == ids(one, STUDY_PARTS)
    suite = skill_parts(1000)
    assert ids(suite, ("warm_start_add",)) == ids(one, ("warm_start_add",))
    with pytest.raises(ValueError, match="layout"):
        skill_parts(0, layout="other")
