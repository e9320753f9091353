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
        # global: each agent's carried mean counts for a tree's worth (8) of observations at the root
        policy = PolicyConfig(agent_scope=scope, global_weight=8.0)
        search = TreeSearch(
            SearchConfig(max_nodes=8, policy=policy), agent_statistics=AgentStatistics()
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
    assert counts["global"]["strong"] > 1.5 * counts["global"]["weak"]
    assert counts["global"]["strong"] > counts["tree"]["strong"] + 80


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


# -- Beta posteriors hold rewards in [0, 1] only -------------------------------------------------


@pytest.mark.parametrize("reward", [-1.0, 1.5])
def test_beta_posterior_refuses_rewards_outside_the_unit_interval(reward: float) -> None:
    stats = RewardStats()
    for r in (0.0, 1.0, reward):
        stats.add(r)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"raw grade reward in \[0, 1\]"):
        thompson_draw(stats, Prior(), rng)
    with pytest.raises(ValueError, match=r"raw grade reward in \[0, 1\]"):
        beta_params(stats, Prior())
    from mars2.search.posterior import thompson_draws

    with pytest.raises(ValueError, match=r"raw grade reward in \[0, 1\]"):
        thompson_draws([RewardStats(), stats], Prior(), rng)
    thompson_draw(stats, Prior(kind="nig"), rng)  # Normal-Inverse-Gamma takes any real reward


# -- refine prompts keep the problem ------------------------------------------------------------


def _failed(tree: SearchTree, code: str | None, text: str = "") -> object:
    from mars2.generation.base import Completion

    feedback = [TestFeedback(Verdict.WRONG_ANSWER, "0", "1", "0", "")] if code else []
    return tree.add(
        0, agent="a", completion=Completion(text=text), grade=Grade(code=code, public=feedback)
    )


def test_refine_prompt_for_a_parent_without_code_omits_its_completion() -> None:
    problem = simulated_problems(1)[0]
    tree = SearchTree.new(problem)
    rambling = "Let me think. " * 2000  # truncated reasoning, no code block
    node = _failed(tree, None, rambling)
    text = PromptBuilder().messages_for(problem, node)[-1]["content"]
    assert problem.statement in text and "no code" in text.lower()
    assert "Let me think" not in text and len(text) < 1000


def test_refine_prompt_caps_the_parent_code() -> None:
    problem = simulated_problems(1)[0]
    tree = SearchTree.new(problem)
    long_code = "".join(f"x{i} = {i}\n" for i in range(5000))
    node = _failed(tree, long_code)
    builder = PromptBuilder(max_code_chars=2000)
    text = builder.messages_for(problem, node)[-1]["content"]
    assert problem.statement in text and "x0 = 0" in text and "x4999" not in text
    assert len(text) < 3000 and "cut" in text


def test_prompt_truncation_cuts_the_code_never_the_statement(tiny_models_dir) -> None:
    from mars2.generation.prompt import encode_prompt
    from mars2.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_models_dir / "tiny_qwen3"))
    problem = simulated_problems(1)[0]
    tree = SearchTree.new(problem)
    node = _failed(tree, "".join(f"y{i} = {i}\n" for i in range(400)))
    chat = PromptBuilder().messages_for(problem, node)
    whole = encode_prompt(tokenizer, chat)
    limit = len(whole) - 300
    ids = encode_prompt(tokenizer, chat, limit)
    assert len(ids) <= limit
    text = tokenizer.decode(ids)
    system = PromptBuilder().system
    assert system in text and problem.statement in text  # the head survives
    assert "Fix it and give the corrected, complete solution." in text  # and so does the tail
    assert "y0 = 0" in text and "y399 = 399" not in text  # the code lost its end
    fresh = PromptBuilder().fresh_messages(problem)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        encode_prompt(tokenizer, fresh, 5)  # nothing to cut but the problem itself: refused


# -- global agent statistics: a weighted prior at the root ---------------------------------------


def _root_choice_rate(scope: str, weight: float, draws: int = 4000) -> float:
    """P(stack picks agent A at the root) with in-tree A 0.6 x3 vs B 0 x3, carried A 0.30 vs B 0.35."""
    tree = SearchTree.new(simulated_problems(1)[0])
    for agent, reward in [("A", 0.6)] * 3 + [("B", 0.0)] * 3:
        tree.add(0, agent=agent, reward=reward)
    stats = TreeStats(tree)
    carried = AgentStatistics()
    for agent, mean in (("A", 0.30), ("B", 0.35)):
        carried.stats[agent] = RewardStats()
        for _ in range(320):  # ten batches of 32 nodes (decay 0.9 keeps about that many)
            carried.stats[agent].add(mean)
    config = PolicyConfig(agent_scope=scope, global_weight=weight)  # type: ignore[arg-type]
    policy = ThompsonPolicy(config)
    rng = np.random.default_rng(0)
    picks = [policy.select(tree, stats, ["A", "B"], rng, carried) for _ in range(draws)]
    return sum(agent == "A" for _, agent in picks) / draws


def test_global_statistics_are_a_prior_of_global_weight_observations() -> None:
    alone = _root_choice_rate("tree", 1.0)
    assert alone == pytest.approx(0.76, abs=0.03)  # the figure
    # One pseudo-observation of each agent's carried mean shifts the choice a little, not to 0.006.
    assert _root_choice_rate("global", 1.0) == pytest.approx(alone, abs=0.08)
    assert _root_choice_rate("global", 0.0) == pytest.approx(alone, abs=0.03)
    assert _root_choice_rate("global", 8.0) > 0.6  # the default: the tree's evidence still leads
    assert _root_choice_rate("global", 500.0) < 0.5  # a heavy prior does outweigh three nodes
    with pytest.raises(ValueError, match="global_weight"):
        PolicyConfig(global_weight=-1.0)


def test_global_statistics_apply_at_the_root_only() -> None:
    tree = SearchTree.new(simulated_problems(1)[0])
    tree.add(0, agent="A", reward=0.0)
    tree.add(1, agent="B", reward=1.0)
    stats = TreeStats(tree)
    carried = AgentStatistics()
    carried.stats["A"] = RewardStats(count=50.0, total=50.0, total_sq=50.0)
    policy = ThompsonPolicy(PolicyConfig(agent_scope="global", global_weight=3.0))
    below = policy.action_posteriors(stats, 1, ["A", "B"], carried)
    assert below == [stats.action(1, "A"), stats.action(1, "B")]
    root = policy.action_posteriors(stats, 0, ["A", "B"], carried)
    assert root[0].count == pytest.approx(stats.action(0, "A").count + 3.0)
    assert root[0].total == pytest.approx(stats.action(0, "A").total + 3.0)
    assert root[1] == stats.action(0, "B")  # nothing carried for B


def test_agent_statistics_sum_batches_across_ranks() -> None:
    """`update(trees, agents, reduce)`: the batch is summed by `reduce` before it is folded in."""
    trees = _grow(1, max_nodes=4)
    alone = AgentStatistics(decay=0.5)
    alone.update(trees)
    halves = [trees[:3], trees[3:]]
    batches = []
    for half in halves:  # what each rank contributes
        probe = AgentStatistics()
        probe.update(half, agents=["a", "b"])
        batches.append(probe)

    other = [batches[1].get(n) for n in ("a", "b")]
    other_flat = [v for s in other for v in (s.count, s.total, s.total_sq, s.outside)]

    def reduce(local: list[float]) -> list[float]:  # the all-reduce, done by hand
        return [x + y for x, y in zip(local, other_flat, strict=True)]

    ranked = AgentStatistics(decay=0.5)
    ranked.update(halves[0], agents=["a", "b"], reduce=reduce)
    for name in ("a", "b"):
        assert vars(ranked.get(name)) == pytest.approx(vars(alone.get(name)))
    with pytest.raises(ValueError, match="agents"):
        ranked.update(halves[0], reduce=reduce)
