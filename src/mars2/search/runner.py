"""The batched rollout driver: grows many trees at once, a round of expansions at a time.

Each round asks the search core (`mars2.search.core`) for up to `expansions_per_round`
expansions per unfinished tree, sends every agent its whole batch of prompts in one call (vLLM is
only fast with large batches), grades all completions in one sandbox batch, then tells the core
every graded answer. The same driver runs the baselines: ``mode="independent"`` is vanilla GRPO
(G fresh samples per problem, no tree), and a team of one agent is a single-agent tree.
``driver="pipelined"`` hands the same search to `mars2.search.pipeline`, where expansions flow
without rounds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from mars2.data.problem import Problem
from mars2.generation.base import Generator
from mars2.search.core import GraderLike, SearchCore
from mars2.search.pipeline import Clock, PipelinedDriver
from mars2.search.policy import AgentStatistics, PolicyConfig, ThompsonPolicy
from mars2.search.prompts import PromptBuilder
from mars2.search.services import SANDBOX, Work, by_agent, generate_into, grade_into
from mars2.search.tree import SearchTree

SearchMode = Literal["tree", "independent"]
Driver = Literal["rounds", "pipelined"]


@dataclass(frozen=True)
class SearchConfig:
    """Budget and shape of the search."""

    mode: SearchMode = "tree"
    max_nodes: int = 8
    expansions_per_round: int = 4  # pipelined: expansions in flight per tree
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    driver: Driver = "rounds"
    clock: Clock = "wall"  # pipelined only: "virtual" replays exactly (see search/pipeline.py)

    def __post_init__(self) -> None:
        if self.mode not in ("tree", "independent"):
            raise ValueError(f"unknown search mode {self.mode!r}: use 'tree' or 'independent'")
        if self.driver not in ("rounds", "pipelined"):
            raise ValueError(f"unknown driver {self.driver!r}: use 'rounds' or 'pipelined'")
        if self.clock not in ("wall", "virtual"):
            raise ValueError(f"unknown clock {self.clock!r}: use 'wall' or 'virtual'")
        if self.max_nodes < 1 or self.expansions_per_round < 1:
            raise ValueError("max_nodes and expansions_per_round must be >= 1")


@dataclass
class SearchTimings:
    """Where a `grow` call spent its wall time, in seconds.

    `busy` holds each service's working seconds (generators by agent name, the grader as
    "sandbox") out of `span`, on the driver's clock (`clock`: virtual seconds for a pipelined run
    on the virtual clock). Pipelined, generation and grading overlap: `generation` is then the
    busiest generator's time and `grading` the sandbox's.
    """

    generation: float = 0.0
    grading: float = 0.0
    bookkeeping: float = 0.0
    rounds: int = 0
    span: float = 0.0
    busy: dict[str, float] = field(default_factory=dict)
    clock: str = "wall"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TreeSearch:
    """Grows one tree per problem with a team of generators and a grader."""

    def __init__(
        self,
        config: SearchConfig | None = None,
        prompts: PromptBuilder | None = None,
        agent_statistics: AgentStatistics | None = None,
    ) -> None:
        # Read here, updated by the caller once a batch is finished (the training callback does).
        self.config = config or SearchConfig()
        self.prompts = prompts or PromptBuilder()
        self.policy = ThompsonPolicy(self.config.policy)
        self.agent_statistics = agent_statistics
        self.timings = SearchTimings()

    def grow(
        self,
        problems: Sequence[Problem],
        generators: Mapping[str, Generator],
        grader: GraderLike,
        rng: np.random.Generator,
        step: int | None = None,
    ) -> list[SearchTree]:
        """Grow a tree for every problem until each reaches `max_nodes` (or cannot widen)."""
        if not generators:
            raise ValueError("a search needs at least one generator")
        if self.config.driver == "pipelined":
            return self._grow_pipelined(problems, generators, grader, rng, step)
        core = SearchCore(
            problems,
            list(generators),
            policy=self.policy,
            prompts=self.prompts,
            max_nodes=self.config.max_nodes,
            rngs=[rng] * len(problems),  # one stream, drawn tree after tree
            independent=self.config.mode == "independent",
            agent_statistics=self.agent_statistics,
            step=step,
        )
        self.timings = SearchTimings()
        started = time.perf_counter()
        while True:
            began = time.perf_counter()
            per_round = self.config.expansions_per_round
            batch = [Work(e) for i in range(len(problems)) for e in core.ask(i, per_round)]
            self.timings.bookkeeping += time.perf_counter() - began
            if not batch:
                break
            self._run_round(batch, core, generators, grader)
            self.timings.rounds += 1
        self.timings.span = time.perf_counter() - started
        return core.trees

    def _grow_pipelined(
        self,
        problems: Sequence[Problem],
        generators: Mapping[str, Generator],
        grader: GraderLike,
        rng: np.random.Generator,
        step: int | None,
    ) -> list[SearchTree]:
        driver = PipelinedDriver(
            self.policy,
            self.prompts,
            self.config.max_nodes,
            self.config.expansions_per_round,
            independent=self.config.mode == "independent",
            agent_statistics=self.agent_statistics,
        )
        trees, report = driver.grow(problems, generators, grader, rng, step, self.config.clock)
        busy = report.usage.busy
        self.timings = SearchTimings(
            generation=max((busy.get(a, 0.0) for a in generators), default=0.0),
            grading=busy.get(SANDBOX, 0.0),
            bookkeeping=report.bookkeeping,
            span=report.usage.span,
            busy=dict(busy),
            clock=report.usage.clock,
        )
        return trees

    def _run_round(
        self,
        batch: list[Work],
        core: SearchCore,
        generators: Mapping[str, Generator],
        grader: GraderLike,
    ) -> None:
        began = time.perf_counter()
        mine = by_agent(batch)
        for agent, generator in generators.items():
            if agent not in mine:
                continue
            called = time.perf_counter()
            generate_into(generator, agent, mine[agent])
            self.timings.busy[agent] = self.timings.busy.get(agent, 0.0) + (
                time.perf_counter() - called
            )
        self.timings.generation += time.perf_counter() - began

        began = time.perf_counter()
        grade_into(grader, batch)
        graded = time.perf_counter() - began
        self.timings.grading += graded
        self.timings.busy[SANDBOX] = self.timings.busy.get(SANDBOX, 0.0) + graded

        began = time.perf_counter()
        for work in batch:
            assert work.completion is not None and work.grade is not None
            core.tell(work.expansion, work.completion, work.grade)
        self.timings.bookkeeping += time.perf_counter() - began
