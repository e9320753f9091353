"""Reward shaping, group advantages and routing, checked against hand-computed trees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars2.rewards.advantages import group_advantages, is_degenerate
from mars2.rewards.routing import AdvantageConfig, route_samples, tree_samples
from mars2.rewards.shaping import shape_rewards
from mars2.search.simulation.environment import simulated_problems
from mars2.search.tree import SearchTree


def _tree(edges: list[tuple[int, str, float]]) -> SearchTree:
    """Build a tree from (parent, agent, reward) in creation order."""
    tree = SearchTree.new(simulated_problems(1)[0])
    for parent, agent, reward in edges:
        tree.add(parent, agent=agent, reward=reward)
    return tree


def test_shaping_by_hand() -> None:
    # root -> 1 (r=0), 2 (r=1), 3 (r=0); 1 -> 4 (r=1), 5 (r=0); 2 -> 6 (r=1, lone child)
    tree = _tree(
        [(0, "a", 0.0), (0, "b", 1.0), (0, "a", 0.0), (1, "b", 1.0), (1, "a", 0.0), (2, "a", 1.0)]
    )
    g, lam = 0.5, 0.5
    shaped = shape_rewards(tree, gamma=g, lam=lam)
    # depth 1: baseline is the leave-one-out sibling mean
    assert shaped[1] == pytest.approx(0 + g * (0 - 0.5))
    assert shaped[2] == pytest.approx(1 + g * (1 - 0.0))
    assert shaped[3] == pytest.approx(0 + g * (0 - 0.5))
    # depth 2 with a sibling: (1-λ)·r_parent + λ·sibling
    assert shaped[4] == pytest.approx(1 + g * (1 - (0.5 * 0 + 0.5 * 0)))
    assert shaped[5] == pytest.approx(0 + g * (0 - (0.5 * 0 + 0.5 * 1)))
    # lone deeper child: parent's reward alone
    assert shaped[6] == pytest.approx(1 + g * (1 - 1))


def test_lone_depth_one_node_keeps_its_reward() -> None:
    assert shape_rewards(_tree([(0, "a", 0.7)])) == {1: 0.7}


def test_all_equal_tree_gives_zero_and_is_filtered() -> None:
    tree = _tree([(0, "a", 1.0), (0, "b", 1.0), (1, "a", 1.0)])
    assert is_degenerate(tree)
    advantages = group_advantages(tree, shape_rewards(tree))
    assert all(a == 0 for a in advantages.values())
    assert tree_samples(tree, 0, AdvantageConfig()) == []
    assert len(tree_samples(tree, 0, AdvantageConfig(filter_degenerate=False))) == 3


def test_advantage_variants_by_hand() -> None:
    tree = _tree([(0, "a", 0.0), (0, "b", 1.0), (1, "a", 1.0)])
    shaped = {1: 0.0, 2: 1.0, 3: 2.0}
    scaled = group_advantages(tree, shaped)
    std = np.std([0.0, 1.0, 2.0])
    assert scaled == pytest.approx({1: -1 / (std + 1e-6), 2: 0.0, 3: 1 / (std + 1e-6)})
    assert group_advantages(tree, shaped, scale_std=False) == pytest.approx(
        {1: -1.0, 2: 0.0, 3: 1.0}
    )
    by_depth = group_advantages(tree, shaped, scale_std=False, group_by="depth")
    assert by_depth == pytest.approx({1: -0.5, 2: 0.5, 3: 0.0})


trees_strategy = st.lists(
    st.tuples(st.integers(0, 30), st.sampled_from(["a", "b", "c"]), st.floats(0, 1)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    edges=trees_strategy,
    gamma=st.floats(0, 2),
    lam=st.floats(0, 1),
    by=st.sampled_from(["tree", "depth"]),
)
def test_advantages_are_zero_mean_per_group(edges, gamma, lam, by) -> None:
    tree = _tree([(p % (i + 1), a, r) for i, (p, a, r) in enumerate(edges)])
    advantages = group_advantages(tree, shape_rewards(tree, gamma, lam), group_by=by)
    groups: dict[int, list[float]] = {}
    for node in tree.answers():
        groups.setdefault(node.depth if by == "depth" else 0, []).append(advantages[node.id])
    for values in groups.values():
        assert abs(sum(values)) < 1e-6 * max(1, len(values))


@settings(max_examples=30, deadline=None)
@given(edges=trees_strategy, seed=st.integers(0, 1000))
def test_shaping_is_order_independent(edges, seed) -> None:
    tree = _tree([(p % (i + 1), a, r) for i, (p, a, r) in enumerate(edges)])
    shaped = shape_rewards(tree)
    rng = np.random.default_rng(seed)
    for node in tree.nodes:  # the same tree with its siblings listed in another order
        node.children = [int(c) for c in rng.permutation(node.children)]
    assert shape_rewards(tree) == pytest.approx(shaped)


def test_routing_by_name_with_a_missing_agent() -> None:
    tree = _tree([(0, "qwen", 0.0), (0, "qwen", 1.0), (1, "llama", 1.0)])
    routed = route_samples([tree], ["llama", "qwen", "idle"])
    assert set(routed) == {"llama", "qwen", "idle"}
    assert routed["idle"] == []
    assert [s.node_id for s in routed["qwen"]] == [1, 2]
    assert [s.node_id for s in routed["llama"]] == [3]
    assert all(s.agent == name for name, samples in routed.items() for s in samples)


def test_routing_rejects_unknown_agents() -> None:
    tree = _tree([(0, "ghost", 0.0), (0, "qwen", 1.0)])
    with pytest.raises(KeyError, match="ghost"):
        route_samples([tree], ["qwen"])


# -- DAPO soft overlong penalty ------------------------------------------------------------------


def test_soft_overlong_penalty_follows_dapo() -> None:
    from mars2.rewards.overlong import OverlongPenalty, soft_overlong_penalty

    # DAPO eq. 13 with L_max = 100, buffer 20: 0 until 80, linear to -1 at 100, -1 beyond
    term = OverlongPenalty(max_tokens=100, buffer=20)
    assert [term(n) for n in (0, 80)] == [0.0, 0.0]
    assert term(81) == pytest.approx(-0.05)
    assert term(90) == pytest.approx(-0.5)
    assert term(100) == -1.0 and term(150) == -1.0
    assert soft_overlong_penalty(95, 100, 20, penalty=2.0) == pytest.approx(-1.5)
    assert soft_overlong_penalty(100, 100, 0) == 0.0  # buffer 0: off
    with pytest.raises(ValueError, match="buffer"):
        OverlongPenalty(max_tokens=10, buffer=20)


# -- the length term comes after shaping and filtering; search statistics never see it ----------


def _truncated(tree: SearchTree, ids: set[int], length: int = 8) -> None:
    from mars2.generation.base import Completion

    for node in tree.answers():
        tokens = [1] * (length if node.id in ids else 2)
        node.completion = Completion(text="", token_ids=tokens, truncated=node.id in ids)


def test_length_term_joins_the_shaped_reward_after_shaping_and_filtering() -> None:
    from mars2.rewards.overlong import OverlongPenalty

    # root -> 1 (r=1, cut at the cap), 2 (r=0); 1 -> 3 (r=0), 4 (r=1)
    tree = _tree([(0, "a", 1.0), (0, "b", 0.0), (1, "a", 0.0), (1, "b", 1.0)])
    _truncated(tree, {1})
    term = OverlongPenalty(max_tokens=8, buffer=4, penalty=1.0)
    config = AdvantageConfig(gamma=0.5, lam=0.5)
    samples = {s.node_id: s for s in tree_samples(tree, 0, config, {"a": term, "b": term})}
    raw = shape_rewards(tree, 0.5, 0.5)
    # Shaping saw raw rewards only: node 1's penalty is in no baseline and is not scaled by 1+γ.
    assert {i: s.shaped_reward for i, s in samples.items()} == pytest.approx(raw)
    assert samples[1].length_term == -1.0 and samples[3].length_term == 0.0
    # The group normalises shaped reward + length term (MARTI, DAPO: the term joins the reward).
    values = np.array([raw[i] + (-1.0 if i == 1 else 0.0) for i in (1, 2, 3, 4)])
    expected = (values - values.mean()) / (values.std() + config.eps)
    assert [samples[i].advantage for i in (1, 2, 3, 4)] == pytest.approx(list(expected))
    # Nothing was written back into the tree: its rewards are the grades'.
    assert [n.reward for n in tree.answers()] == [1.0, 0.0, 0.0, 1.0]


def test_all_fail_tree_with_one_truncated_node_is_still_filtered() -> None:
    from mars2.rewards.overlong import OverlongPenalty

    tree = _tree([(0, "a", 0.0), (0, "b", 0.0), (1, "a", 0.0)])
    _truncated(tree, {2})
    term = OverlongPenalty(max_tokens=8, buffer=4)
    assert tree_samples(tree, 0, AdvantageConfig(), {"a": term, "b": term}) == []


def test_overlong_rollouts_keep_search_statistics_in_the_unit_interval() -> None:
    """Three steps of a global-statistics search whose answers all hit the length cap."""
    from mars2.rewards.overlong import OverlongPenalty
    from mars2.search.policy import AgentStatistics, PolicyConfig
    from mars2.search.runner import SearchConfig, TreeSearch
    from mars2.search.simulation.environment import SimulatedAgent, SimulatedGrader
    from mars2.training.rollout import ProblemSchedule, RolloutEngine

    class Rambling(SimulatedAgent):
        def generate(self, chats):  # type: ignore[no-untyped-def]
            out = super().generate(chats)
            for completion in out:
                completion.token_ids, completion.truncated = [1] * 8, True
            return out

    statistics = AgentStatistics(decay=0.9)
    policy = PolicyConfig(agent_scope="global")
    search = TreeSearch(SearchConfig(max_nodes=6, policy=policy), agent_statistics=statistics)
    engine = RolloutEngine(
        ProblemSchedule(simulated_problems(4), per_step=2, seed=0),
        search,
        SimulatedGrader(),
        agent_statistics=statistics,
    )
    agents = {"a": Rambling(0.4, seed=1), "b": Rambling(0.2, seed=2)}
    term = OverlongPenalty(max_tokens=8, buffer=4)
    for step in range(3):
        data = engine.run(step, agents, overlong={"a": term, "b": term})
        statistics.update(data.trees)
        assert all(0.0 <= n.reward <= 1.0 for t in data.trees for n in t.answers())
        for samples in data.samples.values():
            assert all(s.length_term == -1.0 for s in samples)
    for stats in statistics.stats.values():
        assert 0.0 <= stats.total <= stats.count


def test_advantage_ddof_one_is_the_sample_std() -> None:
    tree = _tree([(0, "a", 0.0), (0, "b", 1.0), (1, "a", 1.0)])
    shaped = {1: 0.0, 2: 1.0, 3: 2.0}
    values = np.array([0.0, 1.0, 2.0])
    sample_std = values.std(ddof=1)  # torch.std's default, as MARTI uses it
    out = group_advantages(tree, shaped, eps=1e-9, ddof=1)
    assert out == pytest.approx({1: -1 / (sample_std + 1e-9), 2: 0.0, 3: 1 / (sample_std + 1e-9)})
    lone = _tree([(0, "a", 0.3)])  # one node: no sample std; its advantage is 0, never NaN
    assert group_advantages(lone, {1: 0.3}, ddof=1) == {1: 0.0}
    config = AdvantageConfig(ddof=1, eps=1e-9)
    samples = tree_samples(tree, 0, config)
    assert [s.advantage for s in samples] == pytest.approx(_normalised(tree, 1, 1e-9))
    with pytest.raises(ValueError, match="ddof"):
        AdvantageConfig(ddof=2)


def _normalised(tree: SearchTree, ddof: int, eps: float) -> list[float]:
    shaped = shape_rewards(tree)
    values = np.array([shaped[n.id] for n in tree.answers()])
    return list((values - values.mean()) / (values.std(ddof=ddof) + eps))


def test_infrastructure_errors_train_nobody() -> None:
    """Issue #42: an answer our sandbox failed to grade (worker killed, E2B down) and its
    descendants leave the rewards; the others' samples are those of the tree without them."""
    from mars2.sandbox.records import Grade

    tree = _tree([(0, "a", 0.0), (0, "b", 1.0), (0, "a", 0.0), (1, "b", 1.0)])
    tree.nodes[1].grade = Grade(code="x", infra_error=True)  # node 4 is its child: dropped with it
    samples = tree_samples(tree, 0, AdvantageConfig(filter_degenerate=False))
    assert sorted(s.node.id for s in samples) == [2, 3]
    clean = _tree([(0, "b", 1.0), (0, "a", 0.0)])
    expected = tree_samples(clean, 0, AdvantageConfig(filter_degenerate=False))
    assert [s.advantage for s in samples] == [s.advantage for s in expected]
