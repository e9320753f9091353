"""The ask/tell search core both drivers run on: budgets, pending counts, exactly-once tells."""

from __future__ import annotations

import numpy as np
import pytest

from mars2.generation.base import Completion
from mars2.sandbox.records import Grade
from mars2.search.core import Expansion, SearchCore
from mars2.search.policy import PolicyConfig, ThompsonPolicy
from mars2.search.prompts import PromptBuilder
from mars2.search.simulation.environment import SimulatedAgent, SimulatedGrader, simulated_problems


def _core(trees: int = 2, max_nodes: int = 5, independent: bool = False) -> SearchCore:
    return SearchCore(
        simulated_problems(trees),
        ["a", "b"],
        policy=ThompsonPolicy(PolicyConfig(refine_solved=True)),
        prompts=PromptBuilder(),
        max_nodes=max_nodes,
        rngs=[np.random.default_rng(i) for i in range(trees)],
        independent=independent,
        step=7,
    )


def _answer(core: SearchCore, expansion: Expansion) -> tuple[Completion, Grade]:
    (completion,) = SimulatedAgent(0.5, seed=expansion.id).generate([expansion.messages])
    (grade,) = SimulatedGrader().grade([(expansion.problem, completion.text)])
    return completion, grade


def test_ask_keeps_to_k_and_to_the_budget_counting_what_is_in_flight() -> None:
    core = _core(max_nodes=5)
    first = core.ask(0, 3)
    assert len(first) == 3 and core.flying == [3, 0] and core.stats[0].pending_total == 3
    assert len(core.ask(0, 3)) == 2  # 3 in flight + 2 = the budget of 5
    assert core.ask(0, 3) == [] and core.in_flight == 5
    for expansion in first:
        node = core.tell(expansion, *_answer(core, expansion))
        assert node.agent == expansion.agent and node.parent == expansion.parent
        assert node.step == 7 and node.messages == expansion.messages
    assert core.flying[0] == 2 and core.stats[0].pending_total == 2
    assert core.ask(0, 3) == []  # 3 answers + 2 in flight: nothing left to ask
    assert len({e.id for e in first}) == 3


def test_every_expansion_is_told_exactly_once() -> None:
    core = _core()
    (expansion,) = core.ask(1, 1)
    answer = _answer(core, expansion)
    core.tell(expansion, *answer)
    with pytest.raises(ValueError, match="exactly once"):
        core.tell(expansion, *answer)
    stranger = _core().ask(0, 1)[0]
    with pytest.raises(ValueError, match="not asked for"):
        core.tell(Expansion(99, 0, 0, "a", [], stranger.problem), *answer)


def test_independent_mode_asks_for_the_whole_group_at_once() -> None:
    core = _core(max_nodes=4, independent=True)
    group = core.ask(0, 1)  # k does not split a GRPO group
    assert [e.agent for e in group] == ["a", "b", "a", "b"]
    assert all(e.parent == 0 for e in group)
    assert core.ask(0, 1) == [] and core.stats[0].pending_total == 0  # no tree: nothing pending
    for expansion in group:
        core.tell(expansion, *_answer(core, expansion))
    assert core.ask(0, 4) == [] and len(core.trees[0]) == 4


def test_core_rejects_a_bad_setup() -> None:
    with pytest.raises(ValueError, match="random generators"):
        SearchCore(simulated_problems(2), ["a"], policy=ThompsonPolicy(), prompts=PromptBuilder(),
                   max_nodes=2, rngs=[np.random.default_rng(0)])  # fmt: skip
    with pytest.raises(ValueError, match="agent"):
        SearchCore(simulated_problems(1), [], policy=ThompsonPolicy(), prompts=PromptBuilder(),
                   max_nodes=2, rngs=[np.random.default_rng(0)])  # fmt: skip
