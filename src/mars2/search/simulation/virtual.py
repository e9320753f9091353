"""The pipelined driver's runtime on a virtual clock: every service in one thread, runs repeat.

Generators with a `latency` engine model (simulated agents) are timed by it; other generators as
batch engines at a nominal `token_seconds` per token of their answers, the grader by its
`latency` pool model or a nominal one (`mars2.search.simulation.latency`). The arrival order is
then a pure function of the inputs: a run, and a resumed run, repeat exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mars2.data.problem import Problem
from mars2.generation.base import Generator
from mars2.search.core import GraderLike
from mars2.search.services import (
    SANDBOX,
    Arrival,
    Usage,
    Work,
    by_agent,
    generate_into,
    grade_into,
)
from mars2.search.simulation.latency import EngineModel, EngineRun, PoolRun, SandboxModel

NOMINAL_TOKEN_SECONDS = 1e-3  # virtual time of a real generator's token (only its order matters)
NOMINAL_SANDBOX = SandboxModel(workers=8, per_test_seconds=0.01, overhead_seconds=0.02)


def tests_per_job(problem: Problem) -> int:
    """Tests the grader runs for one answer: the public ones for feedback, then all of them."""
    return len(problem.public_tests) + len(problem.all_tests)


def engine_model_for(generator: Any) -> EngineModel:
    """The generator's own latency model, else a batch engine at the nominal token time."""
    model = getattr(generator, "latency", None)
    if isinstance(model, EngineModel):
        return model
    capacity = int(getattr(generator, "batch_size", 32))
    return EngineModel(NOMINAL_TOKEN_SECONDS, capacity, contention=0.0, continuous=False)


def sandbox_model_for(grader: Any) -> SandboxModel:
    model = getattr(grader, "latency", None)
    return model if isinstance(model, SandboxModel) else NOMINAL_SANDBOX


class VirtualServices:
    """Runs every service in the calling thread, timed on a virtual clock (see module doc)."""

    def __init__(self, generators: Mapping[str, Generator], grader: GraderLike) -> None:
        self.generators = dict(generators)
        self.grader = grader
        self.engines = {
            name: EngineRun[Work](engine_model_for(g)) for name, g in generators.items()
        }
        self.pool = PoolRun[Work](sandbox_model_for(grader))
        self.now = 0.0

    def _start_generation(self, agent: str) -> None:
        engine = self.engines[agent]
        admitted = engine.admit()
        if admitted:
            generate_into(self.generators[agent], agent, admitted)
            for work in admitted:
                assert work.completion is not None
                engine.start(work, max(1, len(work.completion.token_ids)))

    def _start_grading(self) -> None:
        admitted = self.pool.admit()
        if admitted:
            grade_into(self.grader, admitted)
            for work in admitted:
                self.pool.start(work, tests_per_job(work.problem))

    def generate(self, works: Sequence[Work]) -> None:
        for agent, mine in by_agent(works).items():
            self.engines[agent].submit(mine)
            self._start_generation(agent)

    def grade(self, works: Sequence[Work]) -> None:
        self.pool.submit(works)
        self._start_grading()

    def wait(self) -> Arrival:
        # The earliest finish wins; ties go to the agents in order, then the sandbox.
        best: tuple[float, int] | None = None
        runs: list[EngineRun[Work] | PoolRun[Work]] = [*self.engines.values(), self.pool]
        for index, run in enumerate(runs):
            when = run.next_time()
            if when is not None and (best is None or when < best[0]):
                best = (when, index)
        if best is None:
            raise RuntimeError("waiting for results with nothing in flight")
        when, index = best
        for run in runs:
            if run is not runs[index]:
                run.advance(when)
        self.now = when
        done = runs[index].finish_next()
        if index < len(self.engines):
            self._start_generation(list(self.engines)[index])
            return Arrival("generated", done)
        self._start_grading()
        return Arrival("graded", done)

    def close(self) -> Usage:
        runs: list[EngineRun[Work] | PoolRun[Work]] = [*self.engines.values(), self.pool]
        for run in runs:
            run.advance(max(self.now, run.time))
        span = self.now
        usage = Usage("virtual", span)
        for name, engine in self.engines.items():
            usage.busy[name] = engine.busy_seconds
            usage.occupancy[name] = engine.slot_seconds / max(span * engine.model.capacity, 1e-12)
        usage.busy[SANDBOX] = self.pool.busy_seconds
        usage.occupancy[SANDBOX] = self.pool.slot_seconds / max(
            span * self.pool.model.workers, 1e-12
        )
        return usage
