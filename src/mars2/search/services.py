"""Where the pipelined driver's work runs: each agent's generator and the sandbox, as services.

The driver hands work to a service and waits for whatever comes back first. Two runtimes:

- `WallServices`: real concurrency on the wall clock. A blocking generator gets a thread that
  takes every queued prompt (up to its `batch_size`) as one `generate` call as soon as the
  previous call returns; a `StreamingGenerator` is kept at `max_in_flight` submitted requests; the
  grader gets a thread that grades everything finished so far in one sandbox batch. Results arrive
  in the order they finish, so that order (and what depends on it) varies between runs.
- `VirtualServices`: one thread and a virtual clock (`mars2.search.latency`). Generators with a
  `latency` engine model (simulated agents) are timed by it; other generators as batch engines at
  a nominal `token_seconds` per token of their answers, the grader by its `latency` pool model or
  a nominal one. Arrival order is then a pure function of the inputs: runs repeat exactly.

Both measure each service's busy time (at least one request in flight) over the span.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mars2.data.problem import Problem
from mars2.generation.base import Completion, Generator, Messages, StreamingGenerator
from mars2.sandbox.records import Grade
from mars2.search.latency import EngineModel, EngineRun, PoolRun, SandboxModel

SANDBOX = "sandbox"  # the grader's name in usage reports (agent names are the generators')
NOMINAL_TOKEN_SECONDS = 1e-3  # virtual time of a real generator's token (only its order matters)
NOMINAL_SANDBOX = SandboxModel(workers=8, per_test_seconds=0.01, overhead_seconds=0.02)


class BatchGrader(Protocol):
    """Anything that grades (problem, completion) pairs in one batch."""

    def grade(self, items: Sequence[tuple[Problem, str]]) -> list[Grade]: ...


@dataclass
class Work:
    """One expansion on its way through generation and grading."""

    id: int
    tree: int
    parent: int
    agent: str
    messages: Messages
    problem: Problem
    completion: Completion | None = None
    grade: Grade | None = None


@dataclass
class Arrival:
    """Work that a service finished: generated (to grade next) or graded (to attach)."""

    kind: Literal["generated", "graded"]
    works: list[Work]


@dataclass
class Usage:
    """Busy seconds per service (agents by name, the grader as `SANDBOX`) over `span` seconds.

    `occupancy` (virtual clock only): the mean fraction of a service's slots in use.
    """

    clock: str
    span: float = 0.0
    busy: dict[str, float] = field(default_factory=dict)
    occupancy: dict[str, float] = field(default_factory=dict)


class Services(Protocol):
    def generate(self, works: Sequence[Work]) -> None: ...

    def grade(self, works: Sequence[Work]) -> None: ...

    def wait(self) -> Arrival: ...

    def close(self) -> Usage: ...


def _generate_into(generator: Generator, agent: str, works: Sequence[Work]) -> None:
    outputs = generator.generate([w.messages for w in works])
    if len(outputs) != len(works):
        raise RuntimeError(
            f"generator {agent!r} returned {len(outputs)} completions for {len(works)} prompts"
        )
    for work, output in zip(works, outputs, strict=True):
        work.completion = output


def _grade_into(grader: BatchGrader, works: Sequence[Work]) -> None:
    items = []
    for work in works:
        assert work.completion is not None
        items.append((work.problem, work.completion.text))
    grades = grader.grade(items)
    if len(grades) != len(works):
        raise RuntimeError(f"the grader returned {len(grades)} grades for {len(works)} answers")
    for work, grade in zip(works, grades, strict=True):
        work.grade = grade


def tests_per_job(problem: Problem) -> int:
    """Tests the grader runs for one answer: the public ones for feedback, then all of them."""
    return len(problem.public_tests) + len(problem.all_tests)


# -- virtual clock -----------------------------------------------------------------------------


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

    def __init__(self, generators: Mapping[str, Generator], grader: BatchGrader) -> None:
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
            _generate_into(self.generators[agent], agent, admitted)
            for work in admitted:
                assert work.completion is not None
                engine.start(work, max(1, len(work.completion.token_ids)))

    def _start_grading(self) -> None:
        admitted = self.pool.admit()
        if admitted:
            _grade_into(self.grader, admitted)
            for work in admitted:
                self.pool.start(work, tests_per_job(work.problem))

    def generate(self, works: Sequence[Work]) -> None:
        by_agent: dict[str, list[Work]] = {}
        for work in works:
            by_agent.setdefault(work.agent, []).append(work)
        for agent, mine in by_agent.items():
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


# -- wall clock --------------------------------------------------------------------------------


class _Failure:
    def __init__(self, who: str, error: BaseException) -> None:
        self.who, self.error = who, error


class _BatchWorker:
    """A thread that runs `work_fn` on everything queued (up to `max_batch`) whenever it is free."""

    def __init__(
        self,
        name: str,
        kind: Literal["generated", "graded"],
        work_fn: Callable[[list[Work]], None],
        max_batch: int | None,
        arrivals: queue.Queue[Arrival | _Failure],
    ) -> None:
        self.name, self.kind, self.work_fn, self.max_batch = name, kind, work_fn, max_batch
        self.arrivals = arrivals
        self.inbox: deque[Work] = deque()
        self.ready = threading.Condition()
        self.closed = False
        self.busy_seconds = 0.0
        self.thread = threading.Thread(target=self._loop, name=f"mars2-{name}", daemon=True)
        self.thread.start()

    def put(self, works: Sequence[Work]) -> None:
        with self.ready:
            self.inbox.extend(works)
            self.ready.notify()

    def _loop(self) -> None:
        while True:
            with self.ready:
                while not self.inbox and not self.closed:
                    self.ready.wait()
                if not self.inbox:
                    return
                size = len(self.inbox) if self.max_batch is None else self.max_batch
                batch = [self.inbox.popleft() for _ in range(min(size, len(self.inbox)))]
            began = time.perf_counter()
            try:
                self.work_fn(batch)
            except BaseException as error:  # handed to the driver, which re-raises it
                self.arrivals.put(_Failure(self.name, error))
                return
            finally:
                self.busy_seconds += time.perf_counter() - began
            self.arrivals.put(Arrival(self.kind, batch))

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.inbox.clear()
            self.ready.notify()
        self.thread.join(timeout=60)


class _StreamingFeeder:
    """Keeps a `StreamingGenerator` at `max_in_flight` requests; results arrive one by one."""

    def __init__(
        self, name: str, generator: StreamingGenerator, arrivals: queue.Queue[Arrival | _Failure]
    ) -> None:
        if generator.max_in_flight < 1:
            raise ValueError(f"generator {name!r}: max_in_flight must be >= 1")
        self.name, self.generator, self.arrivals = name, generator, arrivals
        self.waiting: deque[Work] = deque()
        self.in_flight = 0
        self.lock = threading.RLock()  # `done` may be called from inside `submit`
        self.busy_seconds = 0.0
        self._since = 0.0

    def put(self, works: Sequence[Work]) -> None:
        with self.lock:
            self.waiting.extend(works)
            self._pump()

    def _pump(self) -> None:
        room = self.generator.max_in_flight - self.in_flight
        if room <= 0 or not self.waiting:
            return
        chunk = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if self.in_flight == 0:
            self._since = time.perf_counter()
        self.in_flight += len(chunk)

        def done(index: int, output: Completion | BaseException) -> None:
            self._done(chunk[index], output)

        self.generator.submit([w.messages for w in chunk], done)

    def _done(self, work: Work, output: Completion | BaseException) -> None:
        if isinstance(output, BaseException):
            self.arrivals.put(_Failure(self.name, output))
            return
        work.completion = output
        with self.lock:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_seconds += time.perf_counter() - self._since
            self.arrivals.put(Arrival("generated", [work]))
            self._pump()

    def close(self) -> None:
        with self.lock:
            self.waiting.clear()
            if self.in_flight:
                self.busy_seconds += time.perf_counter() - self._since
                self._since = time.perf_counter()


def _generation_fn(generator: Generator, agent: str) -> Callable[[list[Work]], None]:
    def run(works: list[Work]) -> None:
        _generate_into(generator, agent, works)

    return run


def _grading_fn(grader: BatchGrader) -> Callable[[list[Work]], None]:
    def run(works: list[Work]) -> None:
        _grade_into(grader, works)

    return run


class WallServices:
    """Each generator and the grader in its own thread (or a streaming engine's own), real time."""

    def __init__(self, generators: Mapping[str, Generator], grader: BatchGrader) -> None:
        self.arrivals: queue.Queue[Arrival | _Failure] = queue.Queue()
        self.began = time.perf_counter()
        self.generators: dict[str, _BatchWorker | _StreamingFeeder] = {}
        for name, generator in generators.items():
            if isinstance(generator, StreamingGenerator):
                self.generators[name] = _StreamingFeeder(name, generator, self.arrivals)
            else:
                self.generators[name] = _BatchWorker(
                    name,
                    "generated",
                    _generation_fn(generator, name),
                    int(getattr(generator, "batch_size", 0)) or None,
                    self.arrivals,
                )
        self.sandbox = _BatchWorker(SANDBOX, "graded", _grading_fn(grader), None, self.arrivals)

    def generate(self, works: Sequence[Work]) -> None:
        by_agent: dict[str, list[Work]] = {}
        for work in works:
            by_agent.setdefault(work.agent, []).append(work)
        for agent, mine in by_agent.items():
            self.generators[agent].put(mine)

    def grade(self, works: Sequence[Work]) -> None:
        self.sandbox.put(works)

    def wait(self) -> Arrival:
        arrival = self.arrivals.get()
        if isinstance(arrival, _Failure):
            raise RuntimeError(
                f"{arrival.who} failed during a pipelined rollout"
            ) from arrival.error
        return arrival

    def close(self) -> Usage:
        span = time.perf_counter() - self.began
        for worker in [*self.generators.values(), self.sandbox]:
            worker.close()
        usage = Usage("wall", span)
        for name, worker in self.generators.items():
            usage.busy[name] = worker.busy_seconds
        usage.busy[SANDBOX] = self.sandbox.busy_seconds
        return usage
