"""The pipelined driver: exact pending accounting, determinism, timing models, both runtimes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars2.data.problem import Problem
from mars2.generation.base import Completion, DoneCallback, Messages, StreamingGenerator
from mars2.sandbox.records import Grade
from mars2.search.latency import AnswerLengths, EngineModel, SandboxModel, VirtualClock
from mars2.search.pipeline import PipelinedDriver
from mars2.search.policy import PolicyConfig, ThompsonPolicy
from mars2.search.prompts import PromptBuilder
from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.services import SANDBOX, Arrival, Usage, Work
from mars2.search.simulated import SimulatedAgent, SimulatedGrader, simulated_problems
from mars2.search.tree import SearchTree
from mars2.training.rollout import service_usage

# -- timing models, checked against schedules worked out by hand -------------------------------


def test_continuous_engine_refills_a_freed_slot_at_once() -> None:
    engine = EngineModel(token_seconds=1.0, capacity=2, contention=0.0)
    # 3 and 1 tokens start together; at t=1 the second slot takes the 2-token answer (ends t=3).
    assert engine.makespan([3, 1, 2]) == pytest.approx(3.0)
    assert engine.makespan([1, 1, 1, 1, 1]) == pytest.approx(3.0)


def test_batch_engine_waits_for_its_longest_answer() -> None:
    engine = EngineModel(token_seconds=1.0, capacity=2, contention=0.0, continuous=False)
    assert engine.makespan([3, 1, 2]) == pytest.approx(3.0 + 2.0)  # [3, 1] then [2]


def test_contention_slows_each_step_with_the_batch() -> None:
    engine = EngineModel(token_seconds=1.0, capacity=2, contention=1.0)
    assert engine.makespan([2]) == pytest.approx(2 * 1.5)  # one active: 1 * (1 + 1/2)
    assert engine.makespan([2, 2]) == pytest.approx(2 * 2.0)  # two active: 1 * (1 + 2/2)
    # 1 and 3 tokens: one step at 2 s, then two steps alone at 1.5 s.
    assert engine.makespan([1, 3]) == pytest.approx(2.0 + 2 * 1.5)


def test_sandbox_pool_runs_jobs_first_come_first_served() -> None:
    pool = SandboxModel(workers=2, per_test_seconds=1.0, overhead_seconds=0.5)
    assert pool.makespan([1, 1, 1]) == pytest.approx(3.0)  # two at once, then the third
    assert pool.makespan([]) == 0.0


def test_answer_lengths_are_long_tailed_and_capped() -> None:
    lengths = AnswerLengths(median=1000, sigma=0.8, max_tokens=4000)
    rng = np.random.default_rng(0)
    draws = np.array([lengths.draw(rng)[0] for _ in range(4000)])
    assert np.median(draws) == pytest.approx(1000, rel=0.1)
    assert draws.mean() > np.median(draws)  # right-skewed
    assert draws.max() == 4000 and (draws > 3000).mean() > 0.01


def test_simulated_agent_spends_its_batch_makespan_on_the_clock() -> None:
    clock = VirtualClock()
    model = EngineModel(token_seconds=0.5, capacity=4, contention=0.0)
    agent = SimulatedAgent(0.5, lengths=AnswerLengths(), latency=model, clock=clock, name="a")
    chats = [[{"role": "user", "content": f"[sim:{p.id}] x"}] for p in simulated_problems(3)]
    out = agent.generate(chats)
    longest = max(len(c.token_ids) for c in out)
    assert clock.now == pytest.approx(0.5 * longest) and clock.busy == {"a": clock.now}


def test_bad_timing_models_are_rejected() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EngineModel(capacity=0)
    with pytest.raises(ValueError, match="workers"):
        SandboxModel(workers=0)
    with pytest.raises(ValueError, match="driver"):
        SearchConfig(driver="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clock"):
        SearchConfig(clock="sundial")  # type: ignore[arg-type]


# -- the driver's bookkeeping ------------------------------------------------------------------


class CheckedDriver(PipelinedDriver):
    """Asserts after every planning step that budgets and pending counts are exact."""

    def _plan(self, index: int) -> list[Work]:
        planned = super()._plan(index)
        tree, stats = self._trees[index], self._stats[index]
        if not self.independent:
            assert stats.pending_total == self._flying[index]
            assert self._flying[index] <= self.in_flight
        assert len(tree) + self._flying[index] <= self.max_nodes
        return planned


class CountingGrader(SimulatedGrader):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.graded: Counter[str] = Counter()

    def grade(self, items: Sequence[tuple[Problem, str]]) -> list[Grade]:
        self.graded.update(text for _, text in items)
        return super().grade(items)


def _team(seed: int, **latency: object) -> dict[str, SimulatedAgent]:
    return {
        "a": SimulatedAgent(0.3, seed=seed, name="a", **latency),  # type: ignore[arg-type]
        "b": SimulatedAgent(0.1, seed=seed + 1, name="b", **latency),  # type: ignore[arg-type]
    }


def _driver(max_nodes: int, in_flight: int, policy: PolicyConfig | None = None) -> CheckedDriver:
    return CheckedDriver(ThompsonPolicy(policy), PromptBuilder(), max_nodes, in_flight)


def _check_trees(trees: list[SearchTree], driver: CheckedDriver, grader: CountingGrader) -> None:
    for tree, stats in zip(trees, driver._stats, strict=True):
        assert len(tree) <= driver.max_nodes
        assert stats.pending_total == 0
        assert all(s.pending == 0 for s in stats.subtree + stats.children)
        assert all(s.pending == 0 for s in stats.agents.values())
        assert stats.subtree[0].count == len(tree)  # every attached node backpropagated once
    assert sum(driver._flying) == 0
    # Every generated answer was graded exactly once and became exactly one node.
    nodes = [n for t in trees for n in t.answers()]
    assert sum(grader.graded.values()) == len(nodes)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    max_nodes=st.integers(1, 12),
    in_flight=st.integers(1, 6),
    max_depth=st.one_of(st.none(), st.integers(1, 3)),
    max_children=st.one_of(st.none(), st.integers(1, 3)),
)
def test_pending_accounting_is_exact_on_the_virtual_clock(
    seed: int, max_nodes: int, in_flight: int, max_depth: int | None, max_children: int | None
) -> None:
    policy = PolicyConfig(max_depth=max_depth, max_children=max_children, refine_solved=True)
    driver = _driver(max_nodes, in_flight, policy)
    grader = CountingGrader(latency=SandboxModel(workers=3))
    latency = {"lengths": AnswerLengths(median=50), "latency": EngineModel(capacity=4)}
    trees, report = driver.grow(
        simulated_problems(5),
        _team(seed, **latency),
        grader,
        np.random.default_rng(seed),
        clock="virtual",
    )
    _check_trees(trees, driver, grader)
    if max_depth is None and max_children is None:
        assert all(len(t) == max_nodes for t in trees)  # nothing else can stop a tree
    assert report.usage.span > 0 and set(report.usage.busy) == {"a", "b", SANDBOX}


def test_pending_accounting_is_exact_on_the_wall_clock_with_real_sleeps() -> None:
    driver = _driver(max_nodes=6, in_flight=3)
    grader = CountingGrader(latency=SandboxModel(workers=4, per_test_seconds=1e-3), realtime=1.0)
    latency = {
        "lengths": AnswerLengths(median=20, max_tokens=100),
        "latency": EngineModel(token_seconds=1e-4, capacity=8),
        "realtime": 1.0,
    }
    trees, report = driver.grow(
        simulated_problems(8), _team(0, **latency), grader, np.random.default_rng(0), clock="wall"
    )
    assert all(len(t) == 6 for t in trees)
    _check_trees(trees, driver, grader)
    usage = report.usage
    assert usage.clock == "wall" and 0 < usage.busy["a"] <= usage.span
    assert 0 < usage.busy[SANDBOX] <= usage.span


def test_independent_mode_pipelined_is_flat_and_round_robin() -> None:
    search = TreeSearch(
        SearchConfig(mode="independent", max_nodes=4, driver="pipelined", clock="virtual")
    )
    trees = search.grow(
        simulated_problems(3), _team(0), SimulatedGrader(), np.random.default_rng(0)
    )
    for tree in trees:
        assert all(n.depth == 1 for n in tree.answers())
        assert sorted(n.agent for n in tree.answers()) == ["a", "a", "b", "b"]


# -- determinism ---------------------------------------------------------------------------------


class ScriptedServices:
    """Finishes one outstanding item at a time, picked by a seeded draw: a scripted arrival order."""

    def __init__(self, generators: dict[str, SimulatedAgent], grader: SimulatedGrader, order: int):
        self.generators, self.grader = generators, grader
        self.rng = np.random.default_rng(order)
        self.outstanding: list[tuple[str, Work]] = []

    def generate(self, works: Sequence[Work]) -> None:
        self.outstanding.extend(("generate", w) for w in works)

    def grade(self, works: Sequence[Work]) -> None:
        self.outstanding.extend(("grade", w) for w in works)

    def wait(self) -> Arrival:
        kind, work = self.outstanding.pop(int(self.rng.integers(len(self.outstanding))))
        if kind == "generate":
            (work.completion,) = self.generators[work.agent].generate([work.messages])
            return Arrival("generated", [work])
        assert work.completion is not None
        (work.grade,) = self.grader.grade([(work.problem, work.completion.text)])
        return Arrival("graded", [work])

    def close(self) -> Usage:
        return Usage("scripted")


def _scripted(seed: int, order: int) -> list[dict]:
    driver = _driver(max_nodes=8, in_flight=3)
    team, grader = _team(5), SimulatedGrader()
    trees, _ = driver.grow(
        simulated_problems(6),
        team,
        grader,
        np.random.default_rng(seed),
        services=ScriptedServices(team, grader, order),
    )
    return [t.to_dict() for t in trees]


def test_same_seed_and_arrival_order_give_the_same_trees() -> None:
    assert _scripted(seed=1, order=7) == _scripted(seed=1, order=7)
    assert _scripted(seed=1, order=7) != _scripted(seed=1, order=8)  # the order matters
    assert _scripted(seed=1, order=7) != _scripted(seed=2, order=7)  # and so does the seed


def test_virtual_clock_runs_repeat_exactly() -> None:
    def run() -> tuple[list[dict], dict[str, float]]:
        config = SearchConfig(max_nodes=8, driver="pipelined", clock="virtual")
        search = TreeSearch(config)
        latency = {"lengths": AnswerLengths(), "latency": EngineModel(capacity=8)}
        grader = SimulatedGrader(latency=SandboxModel(workers=2))
        trees = search.grow(
            simulated_problems(10), _team(3, **latency), grader, np.random.default_rng(4), step=2
        )
        return [t.to_dict() for t in trees], search.timings.busy

    first, second = run(), run()
    assert first == second
    assert all(n["step"] == 2 for t in first[0] for n in t["nodes"][1:])


# -- runtimes: streaming engines, failures, measurements ---------------------------------------


class TimerStreamingAgent:
    """A stand-in for an async engine (vLLM, which cannot run here): each request finishes on a
    timer thread after a delay; records the most requests it ever held at once."""

    def __init__(self, inner: SimulatedAgent, max_in_flight: int) -> None:
        self.inner, self.max_in_flight = inner, max_in_flight
        self.lock = threading.Lock()
        self.held = self.peak = 0

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        return self.inner.generate(chats)

    def submit(self, chats: Sequence[Messages], done: DoneCallback) -> None:
        with self.lock:
            self.held += len(chats)
            self.peak = max(self.peak, self.held)
        for index, chat in enumerate(chats):
            (completion,) = self.inner.generate([chat])

            def finish(i: int = index, c: Completion = completion) -> None:
                with self.lock:
                    self.held -= 1
                done(i, c)

            threading.Timer(0.001 * (1 + index % 3), finish).start()


def test_streaming_generators_are_kept_at_their_in_flight_limit() -> None:
    streaming = TimerStreamingAgent(SimulatedAgent(0.3, seed=0), max_in_flight=3)
    assert isinstance(streaming, StreamingGenerator)
    driver = _driver(max_nodes=5, in_flight=4)
    grader = CountingGrader()
    trees, report = driver.grow(
        simulated_problems(6),
        {"a": streaming, "b": SimulatedAgent(0.1, seed=1)},
        grader,
        np.random.default_rng(0),
    )
    _check_trees(trees, driver, grader)
    assert streaming.peak == 3  # filled to its limit, never past it
    assert report.usage.busy["a"] > 0


class Broken:
    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        raise OSError("engine died")


@pytest.mark.parametrize("clock", ["wall", "virtual"])
def test_a_failing_generator_fails_the_rollout(clock: str) -> None:
    search = TreeSearch(SearchConfig(max_nodes=3, driver="pipelined", clock=clock))  # type: ignore[arg-type]
    with pytest.raises((RuntimeError, OSError)) as raised:
        search.grow(
            simulated_problems(2),
            {"a": SimulatedAgent(0.3), "b": Broken()},
            SimulatedGrader(),
            np.random.default_rng(0),
        )
    chain = [raised.value, raised.value.__cause__]
    assert any(isinstance(e, OSError) and "engine died" in str(e) for e in chain)


def test_pipelined_keeps_generators_busier_than_rounds_on_the_virtual_clock() -> None:
    problems = simulated_problems(16)
    lengths = AnswerLengths(median=400, sigma=0.8, max_tokens=4000)

    def team(clock: VirtualClock | None) -> dict[str, SimulatedAgent]:
        return {
            name: SimulatedAgent(
                0.2,
                seed=i,
                lengths=lengths,
                latency=EngineModel(token_seconds=0.01 * (i + 1), capacity=64),
                clock=clock,
                name=name,
            )
            for i, name in enumerate(("fast", "slow"))
        }

    clock = VirtualClock()
    rounds = TreeSearch(SearchConfig(max_nodes=8))
    rounds.grow(
        problems,
        team(clock),
        SimulatedGrader(latency=SandboxModel(), clock=clock),
        np.random.default_rng(0),
    )
    piped = TreeSearch(SearchConfig(max_nodes=8, driver="pipelined", clock="virtual"))
    piped.grow(
        problems, team(None), SimulatedGrader(latency=SandboxModel()), np.random.default_rng(0)
    )
    busy_rounds = clock.busy["fast"] / clock.now
    busy_piped = piped.timings.busy["fast"] / piped.timings.span
    assert busy_piped > busy_rounds
    assert piped.timings.span < clock.now  # same 16 x 8 nodes in less (virtual) time


def test_rounds_driver_reports_busy_time_per_service() -> None:
    search = TreeSearch(SearchConfig(max_nodes=4))
    search.grow(simulated_problems(3), _team(0), SimulatedGrader(), np.random.default_rng(0))
    assert set(search.timings.busy) == {"a", "b", SANDBOX}
    assert sum(search.timings.busy.values()) <= search.timings.span


def test_service_usage_metrics() -> None:
    metrics = service_usage({"a": 3.0, "b": 1.0, SANDBOX: 2.0}, 4.0, ["a", "b"])
    assert metrics["a/generator_busy"] == 0.75 and metrics["a/generator_idle_seconds"] == 1.0
    assert metrics["b/generator_busy_seconds"] == 1.0
    assert metrics["sandbox_busy"] == 0.5 and metrics["sandbox_idle_seconds"] == 2.0
    assert metrics["generator_busy"] == pytest.approx((0.75 + 0.25) / 2)


def test_wall_time_is_measured_not_assumed() -> None:
    # A generator that sleeps a known time must show at least that much busy time.
    class Sleepy(SimulatedAgent):
        def generate(self, chats: Sequence[Messages]) -> list[Completion]:
            time.sleep(0.02)
            return super().generate(chats)

    search = TreeSearch(SearchConfig(max_nodes=2, expansions_per_round=1, driver="pipelined"))
    search.grow(
        simulated_problems(1),
        {"a": Sleepy(0.0, seed=0)},
        SimulatedGrader(),
        np.random.default_rng(0),
    )
    assert search.timings.busy["a"] >= 0.04  # two sequential calls of 20 ms each
    assert search.timings.span >= search.timings.busy["a"]


@pytest.mark.parametrize("seed", range(5))
def test_virtual_clock_times_generators_without_a_latency_model(seed: int) -> None:
    # Real generators have no latency model: they are timed as batch engines at a nominal token
    # time (many equal and near-equal event times: float ties must not stall or reorder time).
    team = {
        name: SimulatedAgent(0.2, seed=seed + i, lengths=AnswerLengths(median=30, sigma=1.0))
        for i, name in enumerate(("a", "b"))
    }
    driver = _driver(max_nodes=8, in_flight=3)
    grader = CountingGrader()
    trees, report = driver.grow(
        simulated_problems(20), team, grader, np.random.default_rng(seed), clock="virtual"
    )
    assert all(len(t) == 8 for t in trees)
    _check_trees(trees, driver, grader)
    assert report.usage.busy["a"] <= report.usage.span + 1e-9
