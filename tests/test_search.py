"""The pure search core: posteriors, tree bookkeeping, budgets, the simulated environment."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars2.sandbox.base import Verdict
from mars2.sandbox.records import Grade, TestFeedback
from mars2.search.policy import AgentStatistics, PolicyConfig, ThompsonPolicy, TreeStats
from mars2.search.posterior import Prior, RewardStats, beta_params, nig_params, thompson_draw
from mars2.search.prompts import PromptBuilder
from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.simulated import SimulatedAgent, SimulatedGrader, simulated_problems
from mars2.search.tree import SearchTree, load_trees, save_trees


def test_beta_update_counts_reward_and_pending() -> None:
    stats = RewardStats()
    for r in (1.0, 0.0, 0.25):
        stats.add(r)
    stats.pending = 2
    alpha, beta = beta_params(stats, Prior(alpha=0.5, beta=0.5))
    assert alpha == pytest.approx(0.5 + 1.25)
    assert beta == pytest.approx(0.5 + 1.75 + 2)


def test_nig_posterior_matches_conjugate_formulas() -> None:
    stats = RewardStats()
    data = [0.2, 0.4, 0.9]
    for r in data:
        stats.add(r)
    prior = Prior(kind="nig", alpha=1.0, beta=1.0, mu0=0.0, kappa0=1.0)
    mu, kappa, alpha, beta = nig_params(stats, prior)
    n, mean = 3, np.mean(data)
    assert kappa == 4 and mu == pytest.approx(n * mean / 4)
    assert alpha == pytest.approx(2.5)
    assert beta == pytest.approx(1 + 0.5 * np.sum((np.array(data) - mean) ** 2) + n * mean**2 / 8)
    draws = [thompson_draw(stats, prior, np.random.default_rng(i)) for i in range(2000)]
    assert np.mean(draws) == pytest.approx(mu, abs=0.05)


def test_bad_prior_and_config_are_rejected() -> None:
    with pytest.raises(ValueError, match="posterior"):
        Prior(kind="dirichlet")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="agent_scope"):
        PolicyConfig(agent_scope="everywhere")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        SearchConfig(mode="bfs")  # type: ignore[arg-type]


def _grow(seed: int, **config) -> list[SearchTree]:
    problems = simulated_problems(6)
    agents = {"a": SimulatedAgent(0.3, seed=seed), "b": SimulatedAgent(0.1, seed=seed + 1)}
    search = TreeSearch(SearchConfig(**config))
    return search.grow(problems, agents, SimulatedGrader(), np.random.default_rng(seed))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    max_nodes=st.integers(1, 15),
    per_round=st.integers(1, 6),
    max_depth=st.one_of(st.none(), st.integers(1, 4)),
    max_children=st.one_of(st.none(), st.integers(1, 4)),
)
def test_budgets_are_never_exceeded_and_backprop_counts_match(
    seed, max_nodes, per_round, max_depth, max_children
) -> None:
    policy = PolicyConfig(max_depth=max_depth, max_children=max_children, refine_solved=True)
    trees = _grow(seed, max_nodes=max_nodes, expansions_per_round=per_round, policy=policy)
    for tree in trees:
        assert len(tree) <= max_nodes
        for node in tree.answers():
            assert max_depth is None or node.depth <= max_depth
            assert node.depth == tree.nodes[node.parent].depth + 1
        for node in tree.nodes:
            assert max_children is None or len(node.children) <= max_children
        if max_depth is None and max_children is None:
            assert len(tree) == max_nodes  # nothing else can stop it
        stats = TreeStats(tree)
        assert stats.subtree[0].count == len(tree)  # the root sees every node once
        for node in tree.answers():
            subtree = [node.id]
            for nid in subtree:
                subtree.extend(tree.nodes[nid].children)
            assert stats.subtree[node.id].count == len(subtree)
            assert stats.subtree[node.id].total == pytest.approx(
                sum(tree.nodes[i].reward for i in subtree)
            )
        assert stats.pending_total == 0


def test_pending_counts_spread_parallel_picks() -> None:
    tree = SearchTree.new(simulated_problems(1)[0])
    tree.add(0, agent="a", reward=1.0)
    stats = TreeStats(tree)
    policy = ThompsonPolicy(PolicyConfig(refine_solved=True))
    rng = np.random.default_rng(0)
    for _ in range(30):
        parent = policy.select_node(tree, stats, rng)
        assert parent is not None
        stats.add_pending(tree, parent, "a")
    # Without pending counts every pick would deepen into the one good node; with them they spread.
    assert stats.pending_children[0] > 0 and stats.pending_children[1] > 0


def test_tree_json_round_trip(tmp_path) -> None:
    trees = _grow(3, max_nodes=6)
    path = tmp_path / "trees.jsonl"
    save_trees(trees, path)
    assert load_trees(path) == trees


def test_refinement_prompt_shows_public_failures_only() -> None:
    problem = simulated_problems(1)[0]
    tree = SearchTree.new(problem)
    node = tree.add(
        0,
        agent="a",
        grade=Grade(
            code="print(0)\n", public=[TestFeedback(Verdict.WRONG_ANSWER, "0", "1", "0", "")]
        ),
    )
    text = PromptBuilder().messages_for(problem, node)[-1]["content"]
    assert "print(0)" in text and "Expected:\n1" in text and "Got (wrong_answer):\n0" in text
    assert problem.private_tests[0].output not in text.split("Expected:")[0]
    fresh = PromptBuilder().messages_for(problem, tree.root)[-1]["content"]
    assert "previous attempt" not in fresh


def _skills(count: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    return {p.id: float(rng.beta(1, 6)) for p in simulated_problems(count)}


def test_strong_agent_gets_most_expansions() -> None:
    skills = _skills(200, 0)
    team = {
        "strong": SimulatedAgent(lambda pid: skills[pid], seed=1),
        "weak": SimulatedAgent(lambda pid: 0.2 * skills[pid], seed=2),
    }
    problems = simulated_problems(200)
    counts: dict[str, Counter] = {}
    for scope in ("tree", "global"):
        search = TreeSearch(
            SearchConfig(max_nodes=8, policy=PolicyConfig(agent_scope=scope)),
            agent_statistics=AgentStatistics(),
        )
        counter: Counter = Counter()
        for start in range(0, 200, 40):
            trees = search.grow(
                problems[start : start + 40], team, SimulatedGrader(), np.random.default_rng(start)
            )
            search.agent_statistics.update(trees)  # as the training callback does after each step
            counter.update(n.agent for t in trees for n in t.answers())
        counts[scope] = counter
    assert counts["tree"]["strong"] > counts["tree"]["weak"]
    assert counts["global"]["strong"] > 3 * counts["global"]["weak"]


def test_tree_search_beats_independent_sampling_at_equal_budget() -> None:
    skills = _skills(300, 1)
    problems = simulated_problems(300)

    def solved(mode: str) -> int:
        team = {
            "strong": SimulatedAgent(lambda pid: skills[pid], seed=5),
            "weak": SimulatedAgent(lambda pid: 0.2 * skills[pid], seed=6),
        }
        trees = TreeSearch(SearchConfig(mode=mode, max_nodes=8)).grow(
            problems, team, SimulatedGrader(), np.random.default_rng(7)
        )
        assert all(len(t) == 8 for t in trees) or mode == "tree"
        return sum(t.solved for t in trees)

    tree, independent = solved("tree"), solved("independent")
    assert tree > independent * 1.2, (tree, independent)


def test_independent_mode_is_flat_and_round_robin() -> None:
    trees = _grow(0, mode="independent", max_nodes=4)
    for tree in trees:
        assert all(n.depth == 1 for n in tree.answers())
        assert [n.agent for n in tree.answers()] == ["a", "b", "a", "b"]


def test_agent_statistics_state_round_trip() -> None:
    stats = AgentStatistics(decay=0.5)
    stats.update(_grow(1, max_nodes=4))
    copy = AgentStatistics()
    copy.load_state_dict(stats.state_dict())
    assert copy.state_dict() == stats.state_dict()
