"""The pipelined rollout driver: expansions flow through generation and grading independently.

Each tree keeps up to `in_flight` expansions (the rounds driver's `expansions_per_round`) on
their way; as soon as one of them is graded it is attached, backpropagated, and the tree plans
its next one, until it has `max_nodes` answers. Every agent's generator gets prompts as soon as
they are planned and the sandbox grades answers as soon as they are generated, so nothing waits
for the slowest tree, agent or answer of a round. Pending expansions are counted exactly as in
the rounds driver (`TreeStats.add_pending` when planned, `remove_pending` when attached).

Determinism: tree i draws from its own generator, seeded from the step's `rng` (a function of
seed, step and rank), so its decisions are a function of (seed, step, rank, i) and of the order
in which its own results arrive. On the virtual clock that order is itself a function of the
inputs and runs repeat exactly; on the wall clock it follows real timing, and so do the batches
the generators sample in. The rounds driver stays the reference for exact reproduction.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from mars2.data.problem import Problem
from mars2.generation.base import Generator
from mars2.search.policy import AgentStatistics, ThompsonPolicy, TreeStats
from mars2.search.prompts import PromptBuilder
from mars2.search.services import (
    Arrival,
    BatchGrader,
    Services,
    Usage,
    VirtualServices,
    WallServices,
    Work,
)
from mars2.search.tree import ROOT_ID, SearchTree

Clock = Literal["wall", "virtual"]


@dataclass
class PipelineReport:
    """What a pipelined `grow` measured: service usage and time spent deciding and attaching."""

    usage: Usage
    bookkeeping: float
    arrivals: int


class PipelinedDriver:
    """Grows one tree per problem with work flowing continuously (see the module docstring)."""

    def __init__(
        self,
        policy: ThompsonPolicy,
        prompts: PromptBuilder,
        max_nodes: int,
        in_flight: int,
        independent: bool = False,
        agent_statistics: AgentStatistics | None = None,
    ) -> None:
        if max_nodes < 1 or in_flight < 1:
            raise ValueError("max_nodes and in_flight must be >= 1")
        self.policy = policy
        self.prompts = prompts
        self.max_nodes = max_nodes
        self.in_flight = in_flight
        self.independent = independent
        self.agent_statistics = agent_statistics

    def grow(
        self,
        problems: Sequence[Problem],
        generators: Mapping[str, Generator],
        grader: BatchGrader,
        rng: np.random.Generator,
        step: int | None = None,
        clock: Clock = "wall",
        services: Services | None = None,
    ) -> tuple[list[SearchTree], PipelineReport]:
        """Grow every tree to its budget; return the trees and what the run measured.

        `services` replaces the runtime that `clock` picks (e.g. to script the arrival order).
        """
        if not generators:
            raise ValueError("a search needs at least one generator")
        if clock not in ("wall", "virtual"):
            raise ValueError(f"unknown clock {clock!r}: use 'wall' or 'virtual'")
        self._agents = list(generators)
        self._trees = [SearchTree.new(p) for p in problems]
        self._stats = [TreeStats(t) for t in self._trees]
        seeds = rng.integers(0, 2**63 - 1, size=len(self._trees))
        self._rngs = [np.random.default_rng(int(s)) for s in seeds]
        self._flying = [0] * len(self._trees)
        self._next_id = 0
        self._bookkeeping = 0.0
        if services is None:
            services = (
                VirtualServices(generators, grader)
                if clock == "virtual"
                else WallServices(generators, grader)
            )
        arrivals = 0
        try:
            began = time.perf_counter()
            planned = [w for i in range(len(self._trees)) for w in self._plan(i)]
            self._bookkeeping += time.perf_counter() - began
            services.generate(planned)
            while sum(self._flying):
                arrival = services.wait()
                arrivals += 1
                if arrival.kind == "generated":
                    services.grade(arrival.works)
                else:
                    services.generate(self._attach_and_replan(arrival, step))
        finally:
            usage = services.close()
        return self._trees, PipelineReport(usage, self._bookkeeping, arrivals)

    def _attach_and_replan(self, arrival: Arrival, step: int | None) -> list[Work]:
        began = time.perf_counter()
        planned: list[Work] = []
        for work in arrival.works:
            self._attach(work, step)
            self._flying[work.tree] -= 1
            planned.extend(self._plan(work.tree))
        self._bookkeeping += time.perf_counter() - began
        return planned

    def _work(self, index: int, parent: int, agent: str) -> Work:
        tree = self._trees[index]
        work = Work(
            self._next_id,
            index,
            parent,
            agent,
            self.prompts.messages_for(tree.problem, tree.nodes[parent]),
            tree.problem,
        )
        self._next_id += 1
        self._flying[index] += 1
        return work

    def _plan(self, index: int) -> list[Work]:
        """New expansions for tree `index`, up to its in-flight limit and its budget."""
        tree, stats = self._trees[index], self._stats[index]
        planned: list[Work] = []
        if self.independent:  # G fresh samples at once, agents taking turns
            if len(tree) == 0 and not self._flying[index]:
                for k in range(self.max_nodes):
                    planned.append(self._work(index, ROOT_ID, self._agents[k % len(self._agents)]))
            return planned
        while (
            self._flying[index] < self.in_flight
            and len(tree) + stats.pending_total < self.max_nodes
        ):
            pick = self.policy.select(
                tree, stats, self._agents, self._rngs[index], self.agent_statistics
            )
            if pick is None:  # nothing may be widened now; an arriving result may change that
                break
            parent, agent = pick
            stats.add_pending(tree, parent, agent)
            planned.append(self._work(index, parent, agent))
        return planned

    def _attach(self, work: Work, step: int | None) -> None:
        tree, stats = self._trees[work.tree], self._stats[work.tree]
        completion, grade = work.completion, work.grade
        assert completion is not None and grade is not None
        stats.attach(
            tree, work.parent, work.agent, completion=completion, grade=grade,
            messages=work.messages, step=step, pending=not self.independent,
        )  # fmt: skip
