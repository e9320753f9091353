"""The pipelined rollout driver: expansions flow through generation and grading independently.

Each tree keeps up to `in_flight` expansions (the rounds driver's `expansions_per_round`) on
their way; as soon as one of them is graded it is told to the search core and the tree asks for
its next ones, until it has `max_nodes` answers. Every agent's generator gets prompts as soon as
they are asked for and the sandbox grades answers as soon as they are generated, so nothing waits
for the slowest tree, agent or answer of a round. Planning, pending counts and attaching are the
core's (`mars2.search.core`), exactly as for the rounds driver.

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
from mars2.search.core import GraderLike, SearchCore
from mars2.search.policy import AgentStatistics, ThompsonPolicy
from mars2.search.prompts import PromptBuilder
from mars2.search.services import Services, Usage, WallServices, Work
from mars2.search.tree import SearchTree

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
        grader: GraderLike,
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
        seeds = rng.integers(0, 2**63 - 1, size=len(problems))
        self._core = SearchCore(
            problems,
            list(generators),
            policy=self.policy,
            prompts=self.prompts,
            max_nodes=self.max_nodes,
            rngs=[np.random.default_rng(int(s)) for s in seeds],
            independent=self.independent,
            agent_statistics=self.agent_statistics,
            step=step,
        )
        self._trees, self._stats, self._flying = (
            self._core.trees,
            self._core.stats,
            self._core.flying,
        )
        if services is None:
            if clock == "virtual":
                from mars2.search.simulation.virtual import VirtualServices

                services = VirtualServices(generators, grader)
            else:
                services = WallServices(generators, grader)
        arrivals = 0
        bookkeeping = 0.0
        try:
            began = time.perf_counter()
            planned = [w for i in range(len(self._trees)) for w in self._plan(i)]
            bookkeeping += time.perf_counter() - began
            services.generate(planned)
            while self._core.in_flight:
                arrival = services.wait()
                arrivals += 1
                if arrival.kind == "generated":
                    services.grade(arrival.works)
                    continue
                began = time.perf_counter()
                planned = []
                for work in arrival.works:
                    assert work.completion is not None and work.grade is not None
                    self._core.tell(work.expansion, work.completion, work.grade)
                    planned.extend(self._plan(work.tree))
                bookkeeping += time.perf_counter() - began
                services.generate(planned)
        finally:
            usage = services.close()
        return self._trees, PipelineReport(usage, bookkeeping, arrivals)

    def _plan(self, index: int) -> list[Work]:
        """New expansions for tree `index`, up to its in-flight limit and its budget."""
        return [Work(e) for e in self._core.ask(index, self.in_flight - self._flying[index])]
