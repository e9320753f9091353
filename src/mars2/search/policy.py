"""Thompson-sampled expansion over agent-node pairs (AB-MCTS-A style).

At each node on the way down, one Thompson draw is made for *widening* (a new child here: a fresh
solution at the root, a refinement elsewhere) from the rewards of the node's children, and one for
*deepening* into each child from the rewards of that child's whole subtree. The best draw wins;
descending repeats the choice one level lower. Once a node is picked for widening, the expanding
agent is picked by a Thompson draw over each agent's results: within this tree (``agent_scope=
"tree"``, as AB-MCTS) or with results carried over from earlier trees and steps as a prior
(``"global"``, an agent-responsive prior). Pending expansions count as failures until scored, so
several picks made in one round spread out instead of piling onto one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mars2.search.posterior import Prior, RewardStats, thompson_draw
from mars2.search.tree import ROOT_ID, SearchTree

AgentScope = Literal["tree", "global"]


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the expansion policy."""

    prior: Prior = field(default_factory=Prior)
    max_depth: int | None = None
    max_children: int | None = None
    refine_solved: bool = False
    agent_scope: AgentScope = "tree"
    global_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.agent_scope not in ("tree", "global"):
            raise ValueError(f"unknown agent_scope {self.agent_scope!r}: use 'tree' or 'global'")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        if self.max_children is not None and self.max_children < 1:
            raise ValueError("max_children must be >= 1")


class AgentStatistics:
    """Per-agent reward statistics carried across trees and steps (the agent-responsive prior)."""

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.stats: dict[str, RewardStats] = {}

    def update(self, trees: Sequence[SearchTree]) -> None:
        """Fold a finished batch of trees in, after decaying what was there."""
        for stat in self.stats.values():
            stat.count *= self.decay
            stat.total *= self.decay
            stat.total_sq *= self.decay
        for tree in trees:
            for node in tree.answers():
                assert node.agent is not None
                self.stats.setdefault(node.agent, RewardStats()).add(node.reward)

    def get(self, agent: str) -> RewardStats:
        return self.stats.get(agent, RewardStats())

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "stats": {k: vars(v).copy() for k, v in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = float(state["decay"])
        self.stats = {k: RewardStats(**v) for k, v in state["stats"].items()}


class TreeStats:
    """Posterior statistics of one tree, kept in step with it (rebuildable with `from_tree`)."""

    def __init__(self, tree: SearchTree) -> None:
        self.subtree: list[RewardStats] = []
        self.children: list[RewardStats] = []
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
        self.pending_children.append(0)

    def agent(self, name: str) -> RewardStats:
        return self.agents.setdefault(name, RewardStats())

    def observe(self, tree: SearchTree, node_id: int) -> None:
        """Record a scored node: its own stats, its parent's widening stats, all ancestors."""
        while len(self.subtree) < len(tree.nodes):
            self._grow()
        node = tree.nodes[node_id]
        assert node.parent is not None and node.agent is not None
        self.subtree[node_id].add(node.reward)
        for ancestor in tree.ancestors(node_id):
            self.subtree[ancestor.id].add(node.reward)
        self.children[node.parent].add(node.reward)
        self.agent(node.agent).add(node.reward)

    def _pending(self, tree: SearchTree, parent: int, agent: str, delta: int) -> None:
        self.children[parent].pending += delta
        self.pending_children[parent] += delta
        self.subtree[parent].pending += delta
        for ancestor in tree.ancestors(parent):
            self.subtree[ancestor.id].pending += delta
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
        best, best_score = agents[0], -np.inf
        for name in agents:
            agent_stats = stats.agent(name)
            if self.config.agent_scope == "global" and global_stats is not None:
                agent_stats = agent_stats.merged(global_stats.get(name), self.config.global_weight)
            score = thompson_draw(agent_stats, self.config.prior, rng)
            if score > best_score:
                best, best_score = name, score
        return best

    def select(
        self,
        tree: SearchTree,
        stats: TreeStats,
        agents: Sequence[str],
        rng: np.random.Generator,
        global_stats: AgentStatistics | None = None,
    ) -> tuple[int, str] | None:
        """The next (parent node, agent) expansion, or None when no node may be widened."""
        node = self.select_node(tree, stats, rng)
        if node is None:
            return None
        return node, self.select_agent(stats, agents, rng, global_stats)
