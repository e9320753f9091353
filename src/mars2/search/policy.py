"""Thompson-sampled expansion over agent-node pairs (AB-MCTS-A style), three strategies.

Every strategy walks down from the root; GEN at a node means "a new child here" (a fresh solution
at the root, a refinement elsewhere), CONT means "descend into one of its children".

- ``stack`` (MARS², TreeQuest's multi-LLM AB-MCTS-A ``stack``): at each node, per agent, an action
  posterior (rewards below the children that agent made here), a GEN posterior (rewards of those
  children) and a CONT posterior (rewards further below them). The agent is drawn first from the
  action posteriors, then that agent's GEN vs CONT; CONT descends to the best draw among the
  children that agent made (each child's posterior: its own reward and everything below it).
- ``bandit`` (TreeQuest's ``multiarm_bandit_thompson``): GEN vs CONT shared by all agents; on GEN
  the agent is drawn from each agent's pooled rewards in the tree; CONT picks any child.
- ``flat`` (the first mars2 policy): one argmax over "widen here" (children's rewards) and every
  child's subtree posterior; the agent is drawn once the node is chosen.

With ``agent_scope="global"`` each agent's results carried over from earlier trees and steps
(`AgentStatistics`) act as a prior worth ``global_weight`` observations of that agent's carried
mean reward: ``stack`` adds it to the root's action posteriors only (which agent writes a fresh
solution; deeper choices rest on the evidence of this tree), ``bandit`` and ``flat`` to the
agent draw. Every posterior sees raw grade rewards only. Pending expansions count as failures
until scored, so several picks made in one round spread out; with one expansion per round nothing
is pending at a pick and the walk is the sequential algorithm. With ``assignment="uniform"``
(an ablation) every agent draw is uniform over the candidate agents instead of Thompson
sampling; the node choice is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mars2.search.posterior import Prior, RewardStats, argmax, thompson_draw, thompson_draws
from mars2.search.tree import ROOT_ID, SearchTree

AgentScope = Literal["tree", "global"]
Strategy = Literal["stack", "bandit", "flat"]
STRATEGIES = ("stack", "bandit", "flat")
Assignment = Literal["thompson", "uniform"]


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the expansion policy."""

    prior: Prior = field(default_factory=Prior)
    strategy: Strategy = "stack"
    max_depth: int | None = None
    max_children: int | None = None
    refine_solved: bool = False
    agent_scope: AgentScope = "tree"
    # agent_scope="global": how many observations each agent's carried mean reward counts for
    # (8: about one training tree's worth of evidence).
    global_weight: float = 8.0
    assignment: Assignment = "thompson"  # uniform: the agent is drawn at random (ablation)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown search strategy {self.strategy!r}: use 'stack', 'bandit' or 'flat'"
            )
        if self.assignment not in ("thompson", "uniform"):
            raise ValueError(f"unknown assignment {self.assignment!r}: use 'thompson' or 'uniform'")
        if self.agent_scope not in ("tree", "global"):
            raise ValueError(f"unknown agent_scope {self.agent_scope!r}: use 'tree' or 'global'")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        if self.max_children is not None and self.max_children < 1:
            raise ValueError("max_children must be >= 1")
        if self.global_weight < 0:
            raise ValueError(
                "global_weight (pseudo-observations of the carried statistics) must be >= 0"
            )


class AgentStatistics:
    """Per-agent reward statistics carried across trees and steps (the agent-responsive prior).

    Under data parallelism every rank grows its own trees; `update` with `reduce` (a sum over the
    ranks, e.g. `mars2.training.distributed.sum_across_ranks`) folds in the whole step's batch, so
    every rank, and so every checkpoint, holds the same statistics.
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.stats: dict[str, RewardStats] = {}

    def update(
        self,
        trees: Sequence[SearchTree],
        agents: Sequence[str] | None = None,
        reduce: Callable[[list[float]], list[float]] | None = None,
    ) -> None:
        """Fold a finished batch of trees in, after decaying what was there.

        `reduce` sums the batch's per-agent [count, total, total_sq, outside] over all ranks; it
        needs the team's `agents` (the same list, in the same order, on every rank).
        """
        if reduce is not None and agents is None:
            raise ValueError(
                "update(reduce=...) needs the team's agents, in the same order on every rank"
            )
        batch: dict[str, RewardStats] = {name: RewardStats() for name in agents or []}
        for tree in trees:
            for node in tree.answers():
                assert node.agent is not None
                if node.grade.infra_error:  # a fault of ours says nothing about the agent
                    continue
                batch.setdefault(node.agent, RewardStats()).add(node.reward)
        if reduce is not None:
            assert agents is not None
            if set(batch) != set(agents):
                raise ValueError(
                    f"nodes of agents {sorted(set(batch) - set(agents))} outside the team"
                )
            fields = ("count", "total", "total_sq", "outside")
            flat = [float(getattr(batch[name], f)) for name in agents for f in fields]
            summed = reduce(flat)
            batch = {}
            for i, name in enumerate(agents):
                count, total, total_sq, outside = summed[4 * i : 4 * i + 4]
                batch[name] = RewardStats(count, total, total_sq, 0, round(outside))
        for stat in self.stats.values():
            stat.count *= self.decay
            stat.total *= self.decay
            stat.total_sq *= self.decay
        for name, fresh in batch.items():
            if fresh.count:
                self.stats[name] = self.stats.get(name, RewardStats()).plus(fresh)

    def get(self, agent: str) -> RewardStats:
        return self.stats.get(agent, RewardStats())

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "stats": {k: vars(v).copy() for k, v in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = float(state["decay"])
        self.stats = {k: RewardStats(**v) for k, v in state["stats"].items()}


class TreeStats:
    """Posterior statistics of one tree, kept in step with it (rebuildable from the tree).

    Per node n: ``subtree[n]`` (n and everything below it: n's posterior as a child),
    ``children[n]`` (n's children), ``cont[n]`` (everything below n's children), and per agent
    ``gen_by[n][a]`` / ``cont_by[n][a]`` (the same two restricted to the children agent a made).
    """

    def __init__(self, tree: SearchTree) -> None:
        self.subtree: list[RewardStats] = []
        self.children: list[RewardStats] = []
        self.cont: list[RewardStats] = []
        self.gen_by: list[dict[str, RewardStats]] = []
        self.cont_by: list[dict[str, RewardStats]] = []
        self.pending_children: list[int] = []
        self.agents: dict[str, RewardStats] = {}
        self.pending_total = 0
        for _ in tree.nodes:
            self._grow()
        for node in tree.answers():
            self.observe(tree, node.id)

    def _grow(self) -> None:
        self.subtree.append(RewardStats())
        self.children.append(RewardStats())
        self.cont.append(RewardStats())
        self.gen_by.append({})
        self.cont_by.append({})
        self.pending_children.append(0)

    def agent(self, name: str) -> RewardStats:
        return self.agents.setdefault(name, RewardStats())

    @staticmethod
    def _of(table: dict[str, RewardStats], agent: str) -> RewardStats:
        stats = table.get(agent)
        if stats is None:
            stats = table[agent] = RewardStats()
        return stats

    def action(self, node_id: int, agent: str) -> RewardStats:
        """Rewards below the children `agent` made at `node_id` (its action posterior's data)."""
        gen, cont = self.gen_by[node_id].get(agent), self.cont_by[node_id].get(agent)
        if gen is None:
            return cont or RewardStats()
        return gen if cont is None else gen.plus(cont)

    def _walk(self, tree: SearchTree, parent: int, agent: str, reward: float, delta: int) -> None:
        # delta 0: a scored result; +1/-1: a pending one (counted as a failure until scored)
        nodes = tree.nodes
        touched = [
            self.children[parent],
            self.subtree[parent],
            self._of(self.gen_by[parent], agent),
        ]
        child, current = parent, nodes[parent].parent
        while current is not None:
            touched.append(self.cont[current])
            touched.append(self._of(self.cont_by[current], nodes[child].agent or ""))
            touched.append(self.subtree[current])
            child, current = current, nodes[current].parent
        if delta:
            for stats in touched:
                stats.pending += delta
        else:
            for stats in touched:
                stats.add(reward)

    def observe(self, tree: SearchTree, node_id: int) -> None:
        """Record a scored node: its own stats, its parent's GEN stats, all ancestors' CONT."""
        while len(self.subtree) < len(tree.nodes):
            self._grow()
        node = tree.nodes[node_id]
        assert node.parent is not None and node.agent is not None
        if node.grade.infra_error:  # ungraded by a fault of ours: no evidence for the search
            return
        self.subtree[node_id].add(node.reward)
        self._walk(tree, node.parent, node.agent, node.reward, 0)
        self.agent(node.agent).add(node.reward)

    def attach(
        self,
        tree: SearchTree,
        parent: int,
        agent: str,
        *,
        completion: Any,
        grade: Any,
        messages: Any,
        step: int | None,
        pending: bool,
    ) -> int:
        """Add a graded answer to `tree` (settling its pending expansion) and observe it."""
        if pending:
            self.remove_pending(tree, parent, agent)
        node = tree.add(
            parent, agent, completion=completion, grade=grade, messages=messages, step=step
        )
        self.observe(tree, node.id)
        return node.id

    def _pending(self, tree: SearchTree, parent: int, agent: str, delta: int) -> None:
        self._walk(tree, parent, agent, 0.0, delta)
        self.pending_children[parent] += delta
        self.agent(agent).pending += delta
        self.pending_total += delta

    def add_pending(self, tree: SearchTree, parent: int, agent: str) -> None:
        self._pending(tree, parent, agent, +1)

    def remove_pending(self, tree: SearchTree, parent: int, agent: str) -> None:
        self._pending(tree, parent, agent, -1)


class ThompsonPolicy:
    """Chooses (node to widen, agent to widen it with) for a tree."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    def can_widen(self, tree: SearchTree, stats: TreeStats, node_id: int) -> bool:
        cfg = self.config
        node = tree.nodes[node_id]
        if cfg.max_depth is not None and node.depth >= cfg.max_depth:
            return False
        if (
            cfg.max_children is not None
            and len(node.children) + stats.pending_children[node_id] >= cfg.max_children
        ):
            return False
        return node.is_root or cfg.refine_solved or not node.private_passed

    def _selectable(
        self, tree: SearchTree, stats: TreeStats, node_id: int, memo: dict[int, bool]
    ) -> bool:
        if node_id not in memo:
            memo[node_id] = self.can_widen(tree, stats, node_id) or any(
                self._selectable(tree, stats, c, memo) for c in tree.nodes[node_id].children
            )
        return memo[node_id]

    def select_node(
        self, tree: SearchTree, stats: TreeStats, rng: np.random.Generator
    ) -> int | None:
        """Walk down from the root by Thompson draws; return the node to widen, or None if full."""
        prior = self.config.prior
        memo: dict[int, bool] = {}
        current = ROOT_ID
        while True:
            best_score, best_child = -np.inf, None
            widen_ok = self.can_widen(tree, stats, current)
            if widen_ok:
                best_score = thompson_draw(stats.children[current], prior, rng)
            for child in tree.nodes[current].children:
                if self._selectable(tree, stats, child, memo):
                    score = thompson_draw(stats.subtree[child], prior, rng)
                    if score > best_score:
                        best_score, best_child = score, child
            if best_child is None:
                return current if widen_ok else None
            current = best_child

    def select_agent(
        self,
        stats: TreeStats,
        agents: Sequence[str],
        rng: np.random.Generator,
        global_stats: AgentStatistics | None = None,
    ) -> str:
        """Thompson draw over each agent's results in scope; ties go to the earlier agent."""
        if not agents:
            raise ValueError("no agents to choose from")
        if self.config.assignment == "uniform":
            return agents[int(rng.integers(len(agents)))]
        pooled = self._with_carried([stats.agent(name) for name in agents], agents, global_stats)
        return agents[argmax(thompson_draws(pooled, self.config.prior, rng))]

    def _with_carried(
        self,
        own: list[RewardStats],
        agents: Sequence[str],
        global_stats: AgentStatistics | None,
    ) -> list[RewardStats]:
        """`own` plus, with agent_scope="global", each agent's carried mean reward as a prior of
        `global_weight` observations."""
        if self.config.agent_scope != "global" or global_stats is None:
            return own
        weight = self.config.global_weight
        return [
            mine.plus(global_stats.get(name).as_observations(weight))
            for mine, name in zip(own, agents, strict=True)
        ]

    def action_posteriors(
        self,
        stats: TreeStats,
        node_id: int,
        agents: Sequence[str],
        global_stats: AgentStatistics | None = None,
    ) -> list[RewardStats]:
        """The data of each agent's action posterior at `node_id` (stack); carried statistics
        join at the root only."""
        actions = [stats.action(node_id, name) for name in agents]
        if node_id != ROOT_ID:
            return actions
        return self._with_carried(actions, agents, global_stats)

    def _selectable_children(
        self, tree: SearchTree, stats: TreeStats, node_id: int, memo: dict[int, bool]
    ) -> list[int]:
        return [c for c in tree.nodes[node_id].children if self._selectable(tree, stats, c, memo)]

    def _best_child(self, stats: TreeStats, children: list[int], rng: np.random.Generator) -> int:
        if len(children) == 1:
            return children[0]
        draws = thompson_draws([stats.subtree[c] for c in children], self.config.prior, rng)
        return children[argmax(draws)]

    def select_stack(
        self,
        tree: SearchTree,
        stats: TreeStats,
        agents: Sequence[str],
        rng: np.random.Generator,
        global_stats: AgentStatistics | None = None,
    ) -> tuple[int, str] | None:
        """Agent first, then that agent's GEN vs CONT, at each node on the way down."""
        prior = self.config.prior
        memo: dict[int, bool] = {}
        current = ROOT_ID
        while True:
            widen = self.can_widen(tree, stats, current)
            mine: dict[str, list[int]] = {}
            for child in self._selectable_children(tree, stats, current, memo):
                mine.setdefault(tree.nodes[child].agent or "", []).append(child)
            candidates = list(agents) if widen else [a for a in agents if a in mine]
            if not candidates:
                return None
            actions = self.action_posteriors(stats, current, candidates, global_stats)
            best = candidates[argmax(thompson_draws(actions, prior, rng))]
            if self.config.assignment == "uniform":  # the ablation overrides the draw above
                best = candidates[int(rng.integers(len(candidates)))]
            children = mine.get(best)
            if not children:
                return current, best
            if widen:
                empty = RewardStats()
                gen_cont = [
                    stats.gen_by[current].get(best, empty),
                    stats.cont_by[current].get(best, empty),
                ]
                gen, cont = thompson_draws(gen_cont, prior, rng)
                if gen > cont:
                    return current, best
            current = self._best_child(stats, children, rng)

    def select_bandit(
        self,
        tree: SearchTree,
        stats: TreeStats,
        agents: Sequence[str],
        rng: np.random.Generator,
        global_stats: AgentStatistics | None = None,
    ) -> tuple[int, str] | None:
        """Shared GEN vs CONT at each node; on GEN the agent comes from its pooled rewards."""
        prior = self.config.prior
        memo: dict[int, bool] = {}
        current = ROOT_ID
        while True:
            widen = self.can_widen(tree, stats, current)
            children = self._selectable_children(tree, stats, current, memo)
            if not widen and not children:
                return None
            if widen and not children:
                return current, self.select_agent(stats, agents, rng, global_stats)
            if widen:
                gen, cont = thompson_draws(
                    [stats.children[current], stats.cont[current]], prior, rng
                )
                if gen > cont:
                    return current, self.select_agent(stats, agents, rng, global_stats)
            current = self._best_child(stats, children, rng)

    def select(
        self,
        tree: SearchTree,
        stats: TreeStats,
        agents: Sequence[str],
        rng: np.random.Generator,
        global_stats: AgentStatistics | None = None,
    ) -> tuple[int, str] | None:
        """The next (parent node, agent) expansion, or None when no node may be widened."""
        if not agents:
            raise ValueError("no agents to choose from")
        if self.config.strategy == "stack":
            return self.select_stack(tree, stats, agents, rng, global_stats)
        if self.config.strategy == "bandit":
            return self.select_bandit(tree, stats, agents, rng, global_stats)
        node = self.select_node(tree, stats, rng)
        if node is None:
            return None
        return node, self.select_agent(stats, agents, rng, global_stats)
