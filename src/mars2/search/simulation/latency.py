"""Timing models for simulated rollouts: generation engines, answer lengths, a sandbox, a clock.

All times are seconds of a *virtual* clock: nothing sleeps, so a step of hundreds of trees runs in
well under a second on CPU and every run with the same seeds gives the same times.

- `EngineModel` is one generator. A continuous-batching engine (vLLM) decodes up to `capacity`
  sequences together, one token each per step, and admits a waiting request as soon as a slot
  frees; a batch engine (transformers' `generate`) takes up to `capacity` requests when it is
  empty and returns them all when the longest one ends. A decoding step takes
  ``token_seconds * (1 + contention * active / capacity)``: the per-token time of one sequence,
  growing with the batch as the engine moves from memory- to compute-bound.
- `AnswerLengths` draws answer lengths from a lognormal, cut at `max_tokens` (long-tailed, like
  reasoning models' answers).
- `SandboxModel` is a pool of `workers`, each running one job at a time for
  ``overhead_seconds + per_test_seconds * tests``.
- `TrainerModel` is the trainer of a disaggregated layout (its own GPUs): an update takes
  ``token_seconds`` per trained token, a weight sync ``sync_seconds`` during which servers are
  paused. `training_span` lays steps out on-policy (each rollout after the previous update and
  its sync) or one-step off-policy (step t+1's rollout runs while the trainer updates on step t
  and is paused for the sync that lands in it).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True)
class EngineModel:
    """How fast one generator decodes, and how many sequences it decodes together."""

    token_seconds: float = 0.02
    capacity: int = 256
    contention: float = 0.5
    continuous: bool = True

    def __post_init__(self) -> None:
        if self.token_seconds <= 0 or self.capacity < 1 or self.contention < 0:
            raise ValueError("token_seconds must be > 0, capacity >= 1 and contention >= 0")

    def step_seconds(self, active: int) -> float:
        """Wall time of one decoding step with `active` sequences in the batch."""
        return self.token_seconds * (1.0 + self.contention * active / self.capacity)

    def makespan(self, lengths: Sequence[int]) -> float:
        """Time to generate answers of these lengths submitted together to an idle engine."""
        run: EngineRun[int] = EngineRun(self)
        run.submit(range(len(lengths)))
        for index in run.admit():
            run.start(index, lengths[index])
        while run.next_time() is not None:
            run.finish_next()
            for index in run.admit():
                run.start(index, lengths[index])
        return run.time


@dataclass(frozen=True)
class AnswerLengths:
    """Lognormal answer lengths in tokens: `median`, spread `sigma`, cut at `max_tokens`."""

    median: float = 1500.0
    sigma: float = 0.7
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.median < 1 or self.sigma < 0 or self.max_tokens < 1:
            raise ValueError("median and max_tokens must be >= 1 and sigma >= 0")

    def draw(self, rng: np.random.Generator) -> tuple[int, bool]:
        """One length and whether it was cut at `max_tokens`."""
        raw = float(rng.lognormal(np.log(self.median), self.sigma))
        length = max(1, round(raw))
        return min(length, self.max_tokens), length >= self.max_tokens


@dataclass(frozen=True)
class SandboxModel:
    """A pool of sandbox workers; a job runs all of one answer's tests."""

    workers: int = 32
    per_test_seconds: float = 0.05
    overhead_seconds: float = 0.1

    def __post_init__(self) -> None:
        if self.workers < 1 or self.per_test_seconds < 0 or self.overhead_seconds < 0:
            raise ValueError("workers must be >= 1 and times >= 0")

    def job_seconds(self, tests: int) -> float:
        return self.overhead_seconds + self.per_test_seconds * tests

    def makespan(self, tests: Sequence[int]) -> float:
        """Time to run these jobs submitted together to an idle pool (first come, first served)."""
        free = [0.0] * min(self.workers, max(1, len(tests)))
        for count in tests:
            start = heapq.heappop(free)
            heapq.heappush(free, start + self.job_seconds(count))
        return max(free) if tests else 0.0


@dataclass(frozen=True)
class TrainerModel:
    """How long the trainer's update and the weight sync after it take (disaggregated GPUs)."""

    token_seconds: float = 1.2e-4
    sync_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.token_seconds < 0 or self.sync_seconds < 0:
            raise ValueError("token_seconds and sync_seconds must be >= 0")

    def update_seconds(self, tokens: int) -> float:
        return self.token_seconds * tokens


def training_span(
    rollouts: Sequence[float], updates: Sequence[float], sync: float, max_staleness: int
) -> float:
    """Time to train len(rollouts) steps: rollout i takes `rollouts[i]`, its update `updates[i]`,
    every update is followed by a sync of `sync` seconds.

    max_staleness=0: rollout, update and sync in turn. max_staleness=1: rollout i+1 starts when
    the trainer takes batch i; when the sync after update i lands while rollout i+1 runs, that
    rollout is paused for it (mode=keep); the trainer waits for a batch that is not ready.
    """
    if len(rollouts) != len(updates):
        raise ValueError("one update per rollout")
    if max_staleness not in (0, 1):
        raise ValueError("max_staleness must be 0 or 1")
    if max_staleness == 0:
        return float(sum(rollouts) + sum(updates) + sync * len(updates))
    ready = rollouts[0] if rollouts else 0.0  # when batch i is generated
    free = 0.0  # when the trainer has finished the previous update and its sync
    for i, update in enumerate(updates):
        taken = max(ready, free)
        updated = taken + update
        if i + 1 < len(rollouts):
            done = taken + rollouts[i + 1]
            ready = done + sync if done > updated else done  # paused while the sync ran
        free = updated + sync
    return free


class EngineRun(Generic[T]):
    """An `EngineModel` advanced event by event; items are opaque payloads.

    `submit` queues items; `admit` returns those that may start now (the caller generates them
    and reports each length with `start`); `next_time` / `finish_next` move the clock to the next
    finish. Busy time (at least one sequence decoding) and slot-seconds are accumulated.
    """

    def __init__(self, model: EngineModel) -> None:
        self.model = model
        self.time = 0.0
        self.steps = 0.0  # decoding steps done so far; a sequence ends at its start step + length
        self.waiting: deque[T] = deque()
        self.active: list[tuple[float, int, T]] = []
        self.batch_size = 0  # a batch engine's step time depends on the batch it started with
        self.busy_seconds = 0.0
        self.slot_seconds = 0.0
        self._admitted = 0
        self._seq = 0

    @property
    def load(self) -> int:
        """Sequences occupying slots (admitted, not finished)."""
        return self._admitted

    def _step_seconds(self) -> float:
        active = self.batch_size if not self.model.continuous else len(self.active)
        return self.model.step_seconds(active)

    def submit(self, items: Sequence[T] | range) -> None:
        self.waiting.extend(items)  # type: ignore[arg-type]

    def admit(self) -> list[T]:
        """Items that take a slot now (continuous: any free slot; batch: only an empty engine)."""
        if not self.model.continuous and self._admitted:
            return []
        room = self.model.capacity - self._admitted
        taken = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        self._admitted += len(taken)
        if not self.model.continuous and taken:
            self.batch_size = len(taken)
        return taken

    def start(self, item: T, length: int) -> None:
        """An admitted item begins decoding `length` tokens now."""
        if length < 1:
            raise ValueError("an answer has at least one token")
        end = self.steps + length
        heapq.heappush(self.active, (end, self._seq, item))
        self._seq += 1

    def next_time(self) -> float | None:
        """When the next sequence (batch engine: the whole batch) finishes, or None if idle."""
        if not self.active:
            return None
        return self.time + max(0.0, self._next_end() - self.steps) * self._step_seconds()

    def _next_end(self) -> float:
        if self.model.continuous:
            return self.active[0][0]
        return max(end for end, _, _ in self.active)

    def advance(self, until: float) -> None:
        """Move the clock to `until` (not past the next finish)."""
        elapsed = _elapsed(self.time, until)
        if self.active:
            self.steps += elapsed / self._step_seconds()
            self.busy_seconds += elapsed
            self.slot_seconds += elapsed * self._admitted
        self.time = max(self.time, until)

    def finish_next(self) -> list[T]:
        """Advance to the next finish and return what finished (a batch engine: the whole batch)."""
        when = self.next_time()
        if when is None:
            return []
        end = self._next_end()
        self.advance(when)
        self.steps = max(self.steps, end)  # no float drift: the finishing sequence is exactly done
        done: list[T] = []
        while self.active and self.active[0][0] <= self.steps:
            done.append(heapq.heappop(self.active)[2])
        self._admitted -= len(done)
        return done


@dataclass
class VirtualClock:
    """A shared clock that blocking simulated components advance instead of sleeping.

    `busy` holds the seconds each named component spent working; `now` is the total elapsed.
    """

    now: float = 0.0
    busy: dict[str, float] = field(default_factory=dict)

    def spend(self, who: str, seconds: float) -> None:
        """`who` worked for `seconds` while everything else waited (a blocking call)."""
        self.now += seconds
        self.busy[who] = self.busy.get(who, 0.0) + seconds


class PoolRun(Generic[T]):
    """A `SandboxModel` advanced event by event: first come, first served over its workers."""

    def __init__(self, model: SandboxModel) -> None:
        self.model = model
        self.time = 0.0
        self.waiting: deque[T] = deque()
        self.running: list[tuple[float, int, T]] = []
        self.busy_seconds = 0.0
        self.slot_seconds = 0.0
        self._admitted = 0
        self._seq = 0

    def submit(self, items: Sequence[T]) -> None:
        self.waiting.extend(items)

    def admit(self) -> list[T]:
        """Items a free worker starts now."""
        room = self.model.workers - self._admitted
        taken = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        self._admitted += len(taken)
        return taken

    def start(self, item: T, tests: int) -> None:
        heapq.heappush(self.running, (self.time + self.model.job_seconds(tests), self._seq, item))
        self._seq += 1

    def next_time(self) -> float | None:
        return self.running[0][0] if self.running else None

    def advance(self, until: float) -> None:
        elapsed = _elapsed(self.time, until)
        if self.running:
            self.busy_seconds += elapsed
            self.slot_seconds += elapsed * self._admitted
        self.time = max(self.time, until)

    def finish_next(self) -> list[T]:
        when = self.next_time()
        if when is None:
            return []
        self.advance(when)
        done: list[T] = []
        while self.running and self.running[0][0] <= when:
            done.append(heapq.heappop(self.running)[2])
        self._admitted -= len(done)
        return done


def _elapsed(now: float, until: float) -> float:
    """Seconds from `now` to `until`; a rounding error's worth in the past counts as no time."""
    elapsed = until - now
    if elapsed < -1e-9 * max(1.0, abs(now)):
        raise ValueError("time does not run backwards")
    return max(0.0, elapsed)
