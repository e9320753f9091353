"""The search core both rollout drivers run on: ask for expansions, tell their results.

`SearchCore` holds one tree per problem (TreeQuest's ask/tell shape): ``ask(tree, k)`` plans up
to k new expansions of a tree (Thompson-sampled parent and agent, or in ``independent`` mode the
whole group of fresh samples at once) and ``tell(expansion, completion, grade)`` attaches one
graded answer and backpropagates it. An expansion counts as pending (a failure in every posterior
it will update) from its ask to its tell, so picks made while others are on their way spread out.
The drivers only decide *when* to ask and tell: `mars2.search.runner` in rounds,
`mars2.search.pipeline` as results arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mars2.data.problem import Problem
from mars2.generation.base import Completion, Messages
from mars2.sandbox.records import Grade
from mars2.search.policy import AgentStatistics, ThompsonPolicy, TreeStats
from mars2.search.prompts import PromptBuilder
from mars2.search.tree import ROOT_ID, Node, SearchTree


class GraderLike(Protocol):
    """Grades (problem, completion) pairs in one batch, e.g. `mars2.sandbox.verdict.grader.Grader`."""

    def grade(self, items: Sequence[tuple[Problem, str]]) -> list[Grade]: ...


@dataclass(frozen=True)
class Expansion:
    """One planned expansion: `agent` answers `messages` as a new child of `parent` in tree `tree`."""

    id: int
    tree: int
    parent: int
    agent: str
    messages: Messages
    problem: Problem


class SearchCore:
    """One tree per problem, grown by asking for expansions and telling their graded answers.

    `rngs` holds one generator per tree; the same generator repeated shares one stream across
    trees (the rounds driver), separate ones make each tree's draws independent of the others'
    timing (the pipelined driver).
    """

    def __init__(
        self,
        problems: Sequence[Problem],
        agents: Sequence[str],
        *,
        policy: ThompsonPolicy,
        prompts: PromptBuilder,
        max_nodes: int,
        rngs: Sequence[np.random.Generator],
        independent: bool = False,
        agent_statistics: AgentStatistics | None = None,
        step: int | None = None,
    ) -> None:
        if not agents:
            raise ValueError("a search needs at least one agent")
        if max_nodes < 1:
            raise ValueError("max_nodes must be >= 1")
        if len(rngs) != len(problems):
            raise ValueError(f"{len(rngs)} random generators for {len(problems)} trees")
        self.agents = list(agents)
        self.policy = policy
        self.prompts = prompts
        self.max_nodes = max_nodes
        self.rngs = list(rngs)
        self.independent = independent
        self.agent_statistics = agent_statistics
        self.step = step
        self.trees = [SearchTree.new(p) for p in problems]
        self.stats = [TreeStats(t) for t in self.trees]
        self.flying = [0] * len(self.trees)  # per tree: asked, not yet told
        self._outstanding: set[int] = set()
        self._next_id = 0

    @property
    def in_flight(self) -> int:
        """Expansions asked for and not yet told, over all trees."""
        return len(self._outstanding)

    def ask(self, tree: int, k: int) -> list[Expansion]:
        """Up to `k` new expansions of tree `tree`, within its node budget.

        Fewer (or none) when the budget is reached counting those in flight, or when no node may
        be widened now (a result still on its way may change that). In ``independent`` mode the
        tree's first ask returns its whole group of `max_nodes` fresh samples, agents taking
        turns, whatever `k` (vanilla GRPO samples a group at once), and later asks nothing.
        """
        if self.independent:
            if len(self.trees[tree]) or self.flying[tree]:
                return []
            return [
                self._expansion(tree, ROOT_ID, self.agents[i % len(self.agents)])
                for i in range(self.max_nodes)
            ]
        search_tree, stats, rng = self.trees[tree], self.stats[tree], self.rngs[tree]
        asked: list[Expansion] = []
        while len(asked) < k and len(search_tree) + stats.pending_total < self.max_nodes:
            pick = self.policy.select(search_tree, stats, self.agents, rng, self.agent_statistics)
            if pick is None:
                break
            parent, agent = pick
            stats.add_pending(search_tree, parent, agent)
            asked.append(self._expansion(tree, parent, agent))
        return asked

    def tell(self, expansion: Expansion, completion: Completion, grade: Grade) -> Node:
        """Attach `expansion`'s graded answer to its tree and backpropagate it; return the node."""
        if expansion.id not in self._outstanding:
            raise ValueError(
                f"expansion {expansion.id} was not asked for or was already told: every "
                "expansion is told exactly once"
            )
        self._outstanding.remove(expansion.id)
        self.flying[expansion.tree] -= 1
        tree, stats = self.trees[expansion.tree], self.stats[expansion.tree]
        node_id = stats.attach(
            tree, expansion.parent, expansion.agent, completion=completion, grade=grade,
            messages=expansion.messages, step=self.step, pending=not self.independent,
        )  # fmt: skip
        return tree.nodes[node_id]

    def _expansion(self, tree: int, parent: int, agent: str) -> Expansion:
        search_tree = self.trees[tree]
        messages = self.prompts.messages_for(search_tree.problem, search_tree.nodes[parent])
        expansion = Expansion(self._next_id, tree, parent, agent, messages, search_tree.problem)
        self._next_id += 1
        self._outstanding.add(expansion.id)
        self.flying[tree] += 1
        return expansion
