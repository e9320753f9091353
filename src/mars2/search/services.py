"""Where the drivers' work runs: each agent's generator and the sandbox, as services.

A `Work` carries one expansion (`mars2.search.core`) through generation and grading. The rounds
driver calls `generate_into` / `grade_into` on a round's works; the pipelined driver hands works to
a runtime and waits for whatever comes back first:

- `WallServices` (here): real concurrency on the wall clock. A blocking generator gets a thread
  that takes every queued prompt (up to its `batch_size`) as one `generate` call as soon as the
  previous call returns; a `StreamingGenerator` (vLLM's engine driven request by request,
  `mars2.generation.vllm_async`) is kept at `max_in_flight` submitted requests and hands back each
  answer as it finishes; the grader gets a thread that grades everything finished so far in one
  sandbox batch. Results arrive in the order they finish, so that order (and what depends on it)
  varies between runs.
- `VirtualServices` (`mars2.search.simulation.virtual`): one thread on a modelled clock, where
  runs repeat exactly.

Both measure each service's busy time (at least one request in flight) over the span.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from mars2.data.problem import Problem
from mars2.generation.base import Completion, Generator, Messages, StreamingGenerator
from mars2.sandbox.records import Grade
from mars2.search.core import Expansion, GraderLike

SANDBOX = "sandbox"  # the grader's name in usage reports (agent names are the generators')


@dataclass
class Work:
    """One expansion on its way through generation and grading."""

    expansion: Expansion
    completion: Completion | None = None
    grade: Grade | None = None

    @property
    def tree(self) -> int:
        return self.expansion.tree

    @property
    def agent(self) -> str:
        return self.expansion.agent

    @property
    def messages(self) -> Messages:
        return self.expansion.messages

    @property
    def problem(self) -> Problem:
        return self.expansion.problem


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
    """A pipelined runtime: takes works to generate or grade, returns them as they finish."""

    def generate(self, works: Sequence[Work]) -> None: ...

    def grade(self, works: Sequence[Work]) -> None: ...

    def wait(self) -> Arrival: ...

    def close(self) -> Usage: ...


def by_agent(works: Sequence[Work]) -> dict[str, list[Work]]:
    """Works grouped by the agent that answers them, in order."""
    groups: dict[str, list[Work]] = {}
    for work in works:
        groups.setdefault(work.agent, []).append(work)
    return groups


def generate_into(generator: Generator, agent: str, works: Sequence[Work]) -> None:
    """One blocking `generate` call for `works`; each gets its completion."""
    outputs = generator.generate([w.messages for w in works])
    if len(outputs) != len(works):
        raise RuntimeError(
            f"generator {agent!r} returned {len(outputs)} completions for {len(works)} prompts"
        )
    for work, output in zip(works, outputs, strict=True):
        work.completion = output


def grade_into(grader: GraderLike, works: Sequence[Work]) -> None:
    """One sandbox batch for `works`; each gets its grade."""
    items = []
    for work in works:
        assert work.completion is not None
        items.append((work.problem, work.completion.text))
    grades = grader.grade(items)
    if len(grades) != len(works):
        raise RuntimeError(f"the grader returned {len(grades)} grades for {len(works)} answers")
    for work, grade in zip(works, grades, strict=True):
        work.grade = grade


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
            try:
                self._pump()
            except BaseException as error:  # raised on the engine's thread: hand it to the driver
                self.arrivals.put(_Failure(self.name, error))

    def close(self) -> None:
        with self.lock:
            self.waiting.clear()
            if self.in_flight:
                self.busy_seconds += time.perf_counter() - self._since
                self._since = time.perf_counter()
        # The rollout is over for this generator: one that holds resources between rollouts
        # gives them back (a vLLM engine cancels what a failed rollout left and may sleep).
        release = getattr(self.generator, "release", None)
        if release is not None:
            release()


def _generation_fn(generator: Generator, agent: str) -> Callable[[list[Work]], None]:
    def run(works: list[Work]) -> None:
        generate_into(generator, agent, works)

    return run


def _grading_fn(grader: GraderLike) -> Callable[[list[Work]], None]:
    def run(works: list[Work]) -> None:
        grade_into(grader, works)

    return run


class WallServices:
    """Each generator and the grader in its own thread (or a streaming engine's own), real time."""

    def __init__(self, generators: Mapping[str, Generator], grader: GraderLike) -> None:
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
        for agent, mine in by_agent(works).items():
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
