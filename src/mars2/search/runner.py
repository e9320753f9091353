"""The batched rollout driver: grows many trees at once, a round of expansions at a time.

Each round picks up to `expansions_per_round` (node, agent) pairs per unfinished tree, sends every
agent its whole batch of prompts in one call (vLLM is only fast with large batches), grades all
completions in one sandbox batch, then attaches and backpropagates the new nodes. The same driver
runs the baselines: ``mode="independent"`` is vanilla GRPO (G fresh samples per problem, no tree),
and a team of one agent is a single-agent tree. ``driver="pipelined"`` hands the same search to
`mars2.search.pipeline`, where expansions flow without rounds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from mars2.data.problem import Problem
from mars2.generation.base import Generator, Messages
from mars2.sandbox.records import Grade
from mars2.search.pipeline import Clock, PipelinedDriver
from mars2.search.policy import AgentStatistics, PolicyConfig, ThompsonPolicy, TreeStats
from mars2.search.prompts import PromptBuilder
from mars2.search.services import SANDBOX
from mars2.search.tree import ROOT_ID, SearchTree

SearchMode = Literal["tree", "independent"]
Driver = Literal["rounds", "pipelined"]


class GraderLike(Protocol):
    """Anything that grades (problem, completion) pairs, e.g. `mars2.sandbox.verdict.grader.Grader`."""

    def grade(self, items: Sequence[tuple[Problem, str]]) -> list[Grade]: ...


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


@dataclass(frozen=True)
class _Expansion:
    tree: int
    parent: int
    agent: str
    messages: Messages


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
        agents = list(generators)
        trees = [SearchTree.new(p) for p in problems]
        stats = [TreeStats(t) for t in trees]
        self.timings = SearchTimings()
        started = time.perf_counter()
        while True:
            began = time.perf_counter()
            batch = self._plan_round(trees, stats, agents, rng)
            self.timings.bookkeeping += time.perf_counter() - began
            if not batch:
                break
            self._run_round(batch, trees, stats, generators, grader, step)
            self.timings.rounds += 1
        self.timings.span = time.perf_counter() - started
        return trees

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

    def _plan_round(
        self,
        trees: list[SearchTree],
        stats: list[TreeStats],
        agents: list[str],
        rng: np.random.Generator,
    ) -> list[_Expansion]:
        budget = self.config.max_nodes
        batch: list[_Expansion] = []
        for index, (tree, tree_stats) in enumerate(zip(trees, stats, strict=True)):
            if self.config.mode == "independent":
                if len(tree) == 0:  # one round: G fresh samples, agents taking turns
                    for k in range(budget):
                        agent = agents[k % len(agents)]
                        batch.append(
                            _Expansion(
                                index, ROOT_ID, agent, self.prompts.fresh_messages(tree.problem)
                            )
                        )
                continue
            for _ in range(self.config.expansions_per_round):
                if len(tree) + tree_stats.pending_total >= budget:
                    break
                pick = self.policy.select(tree, tree_stats, agents, rng, self.agent_statistics)
                if pick is None:
                    break
                parent, agent = pick
                tree_stats.add_pending(tree, parent, agent)
                messages = self.prompts.messages_for(tree.problem, tree.nodes[parent])
                batch.append(_Expansion(index, parent, agent, messages))
        return batch

    def _run_round(
        self,
        batch: list[_Expansion],
        trees: list[SearchTree],
        stats: list[TreeStats],
        generators: Mapping[str, Generator],
        grader: GraderLike,
        step: int | None,
    ) -> None:
        began = time.perf_counter()
        completions: list[Any] = [None] * len(batch)
        for agent, generator in generators.items():
            slots = [i for i, e in enumerate(batch) if e.agent == agent]
            if not slots:
                continue
            called = time.perf_counter()
            outputs = generator.generate([batch[i].messages for i in slots])
            self.timings.busy[agent] = self.timings.busy.get(agent, 0.0) + (
                time.perf_counter() - called
            )
            if len(outputs) != len(slots):
                raise RuntimeError(
                    f"generator {agent!r} returned {len(outputs)} completions for {len(slots)} prompts"
                )
            for i, output in zip(slots, outputs, strict=True):
                completions[i] = output
        self.timings.generation += time.perf_counter() - began

        began = time.perf_counter()
        grades = grader.grade(
            [(trees[e.tree].problem, c.text) for e, c in zip(batch, completions, strict=True)]
        )
        self.timings.grading += time.perf_counter() - began
        self.timings.busy[SANDBOX] = self.timings.busy.get(SANDBOX, 0.0) + (
            time.perf_counter() - began
        )

        began = time.perf_counter()
        for expansion, completion, grade in zip(batch, completions, grades, strict=True):
            tree, tree_stats = trees[expansion.tree], stats[expansion.tree]
            tree_stats.attach(
                tree, expansion.parent, expansion.agent, completion=completion, grade=grade,
                messages=expansion.messages, step=step, pending=self.config.mode == "tree",
            )  # fmt: skip
        self.timings.bookkeeping += time.perf_counter() - began
