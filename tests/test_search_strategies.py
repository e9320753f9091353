"""Search strategies: `stack` and `bandit` against the installed TreeQuest, in distribution."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mars2.search.policy import STRATEGIES, PolicyConfig, ThompsonPolicy, TreeStats
from mars2.search.posterior import RewardStats
from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.simulation.environment import SimulatedAgent, SimulatedGrader, simulated_problems
from mars2.search.tree import SearchTree

AGENTS = ["a", "b"]
N = 3000

# (parent id, agent, reward) in creation order; node ids start at 1 (0 is the root).
SCENARIOS = {
    "four_failed": [(0, "a", 0.0), (0, "b", 0.0), (0, "a", 0.0), (0, "b", 0.0)],
    "eight_half": [(0, AGENTS[i % 2], 0.5) for i in range(8)],
    "mixed": [
        (0, "a", 1.0),
        (0, "b", 0.0),
        (0, "a", 0.0),
        (0, "b", 0.3),
        (1, "b", 1.0),
        (1, "a", 0.0),
        (2, "a", 0.6),
        (5, "a", 0.0),
        (5, "b", 0.2),
    ],
}
TREEQUEST_STRATEGY = {"stack": "stack", "bandit": "multiarm_bandit_thompson"}


def _ours(scenario: list[tuple[int, str, float]], strategy: str, seed: int) -> Counter:
    tree = SearchTree.new(simulated_problems(1)[0])
    for parent, agent, reward in scenario:
        tree.add(parent, agent=agent, reward=reward)
    stats = TreeStats(tree)
    policy = ThompsonPolicy(PolicyConfig(strategy=strategy))  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    picks: Counter = Counter()
    for _ in range(N):
        pick = policy.select(tree, stats, AGENTS, rng)
        assert pick is not None
        picks[pick] += 1
    return picks


def _treequest(scenario: list[tuple[int, str, float]], strategy: str, seed: int) -> Counter:
    treequest = pytest.importorskip("treequest")
    algo = treequest.ABMCTSA(dist_type="beta", model_selection_strategy=strategy)
    state = algo.init_tree()
    for agent in AGENTS:
        state.all_rewards_store[agent] = []
    for parent, agent, reward in scenario:  # TreeQuest numbers the root -1, then 0, 1, ...
        node = state.tree.get_node(parent - 1)
        state.thompson_states.get_or_create(node, AGENTS)
        trial = state.trial_store.create_trial(node, agent)
        algo.tell(state, trial.trial_id, ("answer", reward))
    np.random.seed(seed)  # TreeQuest draws through scipy, i.e. numpy's global generator
    picks: Counter = Counter()
    for _ in range(N):
        node, agent = algo._get_expand_node_and_action(state, AGENTS)
        picks[(node.expand_idx + 1, agent)] += 1
    return picks


def _assert_same_distribution(ours: Counter, theirs: Counter) -> None:
    for key in set(ours) | set(theirs):
        p, q = ours[key] / N, theirs[key] / N
        pooled = (p + q) / 2
        tolerance = 4.5 * np.sqrt(pooled * (1 - pooled) * 2 / N) + 0.005  # ~4.5 sigma
        assert abs(p - q) <= tolerance, (key, p, q, dict(ours), dict(theirs))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("strategy", ["stack", "bandit"])
def test_strategy_matches_treequest_abmctsa(strategy: str, scenario: str) -> None:
    steps = SCENARIOS[scenario]
    ours = _ours(steps, strategy, seed=1)
    theirs = _treequest(steps, TREEQUEST_STRATEGY[strategy], seed=2)
    _assert_same_distribution(ours, theirs)


def test_stack_widens_the_root_as_treequest_does() -> None:
    """Root widening as the posteriors say (flat: 5% with 4 failed children, 2% with 8 halves)."""
    widen = {}
    for name in ("four_failed", "eight_half"):
        picks = _ours(SCENARIOS[name], "stack", seed=3)
        widen[name] = sum(v for (node, _), v in picks.items() if node == 0) / N
    # Each agent made 2 failed children: its GEN is Beta(0.5, 2.5), its CONT still the Jeffreys
    # prior Beta(0.5, 0.5). With 4 halves each, GEN is Beta(2.5, 2.5): symmetric, 0.5.
    draws = np.random.default_rng(4)
    expected = float(np.mean(draws.beta(0.5, 2.5, 200_000) > draws.beta(0.5, 0.5, 200_000)))
    assert abs(widen["four_failed"] - expected) < 0.03  # ~0.23
    assert abs(widen["eight_half"] - 0.5) < 0.04
    flat = _ours(SCENARIOS["eight_half"], "flat", seed=3)
    assert sum(v for (node, _), v in flat.items() if node == 0) / N < 0.1


def _brute_force(tree: SearchTree, node_id: int) -> tuple[dict[str, float], dict[str, float]]:
    """Sum of rewards of the children each agent made at node_id, and of everything below them."""
    gen: dict[str, float] = {}
    cont: dict[str, float] = {}
    for child in tree.nodes[node_id].children:
        agent = tree.nodes[child].agent or ""
        gen[agent] = gen.get(agent, 0.0) + tree.nodes[child].reward
        stack = list(tree.nodes[child].children)
        while stack:
            below = stack.pop()
            cont[agent] = cont.get(agent, 0.0) + tree.nodes[below].reward
            stack.extend(tree.nodes[below].children)
    return gen, cont


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("per_round", [1, 4])
def test_batched_rounds_keep_budgets_and_stats_for_every_strategy(
    strategy: str, per_round: int
) -> None:
    problems = simulated_problems(8)
    team = {"a": SimulatedAgent(0.3, seed=1), "b": SimulatedAgent(0.1, seed=2)}
    config = SearchConfig(
        max_nodes=12,
        expansions_per_round=per_round,
        policy=PolicyConfig(strategy=strategy, max_children=3),  # type: ignore[arg-type]
    )
    trees = TreeSearch(config).grow(
        problems, team, SimulatedGrader("pass_rate"), np.random.default_rng(0)
    )
    depths = []
    for tree in trees:
        assert len(tree) <= 12 and all(len(n.children) <= 3 for n in tree.nodes)
        stats = TreeStats(tree)
        assert stats.pending_total == 0
        for node in tree.nodes:
            gen, cont = _brute_force(tree, node.id)
            for agent in AGENTS:
                assert stats.gen_by[node.id].get(agent, RewardStats()).total == pytest.approx(
                    gen.get(agent, 0.0)
                )
                assert stats.cont_by[node.id].get(agent, RewardStats()).total == pytest.approx(
                    cont.get(agent, 0.0)
                )
            assert stats.cont[node.id].total == pytest.approx(sum(cont.values()))
        depths.extend(n.depth for n in tree.answers())
    assert max(depths) >= 2  # refinements happen


def test_unknown_strategy_is_a_clear_config_error() -> None:
    with pytest.raises(ValueError, match="unknown search strategy 'nope'"):
        PolicyConfig(strategy="nope")  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_normal_inverse_gamma_posteriors_work_with_every_strategy(strategy: str) -> None:
    from mars2.search.posterior import Prior

    team = {"a": SimulatedAgent(0.4, seed=3), "b": SimulatedAgent(0.1, seed=4)}
    config = SearchConfig(
        max_nodes=10,
        expansions_per_round=3,
        policy=PolicyConfig(strategy=strategy, prior=Prior(kind="nig", alpha=1.0, beta=0.1)),  # type: ignore[arg-type]
    )
    trees = TreeSearch(config).grow(
        simulated_problems(6), team, SimulatedGrader("pass_rate"), np.random.default_rng(1)
    )
    assert all(len(t) == 10 for t in trees)
    assert {n.agent for t in trees for n in t.answers()} == {"a", "b"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_uniform_assignment_ignores_the_agents_results(strategy: str) -> None:
    # "a" solved three times at the root, "b" failed three times, and only the root may be
    # widened (max_depth=1), so every pick is one agent draw: Thompson sampling sends nearly every
    # expansion to "a", the uniform ablation splits them evenly whatever the results.
    scenario = [(0, "a", 1.0), (0, "b", 0.0)] * 3
    shares = {}
    for assignment in ("thompson", "uniform"):
        tree = SearchTree.new(simulated_problems(1)[0])
        for parent, agent, reward in scenario:
            tree.add(parent, agent=agent, reward=reward)
        stats = TreeStats(tree)
        config = PolicyConfig(strategy=strategy, assignment=assignment, max_depth=1)  # type: ignore[arg-type]
        policy, rng = ThompsonPolicy(config), np.random.default_rng(0)
        agents = Counter(policy.select(tree, stats, AGENTS, rng)[1] for _ in range(N))  # type: ignore[index]
        shares[assignment] = agents["a"] / N
    assert shares["thompson"] > 0.8
    assert abs(shares["uniform"] - 0.5) < 4.5 * np.sqrt(0.25 / N)


def test_unknown_assignment_is_a_clear_config_error() -> None:
    with pytest.raises(ValueError, match="unknown assignment 'random'"):
        PolicyConfig(assignment="random")  # type: ignore[arg-type]
