"""A short tiny_pair run that records every batch handed to the trainer, for tests/test_staleness.py.

Runs against the checkout whose root is MARS2_CHECKOUT (default: this one), its sources first on
PYTHONPATH: tests/test_staleness.py runs it against this checkout and against `main`, to show
max_staleness=0 changes nothing. tiny_qwen3 samples
for real (transformers backend), tiny_llama answers from a script, so rewards are mixed and both
agents train. Writes a torch file: per step, the micro-batch tensors and the step's metrics that
are not timings, then the logged metrics and each agent's final weights; once with the rounds
driver and once with the pipelined one on the virtual clock, each in its own run folder.
    python tests/staleness_run.py <out.pt> <tmp dir> <tiny models dir> <hydra overrides>
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(os.environ.get("MARS2_CHECKOUT") or Path(__file__).resolve().parents[1])
sys.path.insert(0, str(ROOT))  # that checkout's tests package (and so its configs)

from mars2.generation.transformers_backend import ScriptedGenerator  # noqa: E402
from mars2.training.run import build_run  # noqa: E402
from tests.test_training import compose_run, scripted_answer  # noqa: E402

TIMINGS = ("seconds", "busy", "per_second")  # wall-clock dependent: never equal twice


def untimed(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if not any(t in k for t in TIMINGS)}


DRIVERS = {
    "rounds": ("search.config.driver=rounds",),
    "pipelined": ("search.config.driver=pipelined", "search.config.clock=virtual"),
}


def main(out: str, tmp: str, tiny: str, overrides: list[str]) -> None:
    records = {name: record(Path(tmp) / name, tiny, [*driver, *overrides])
               for name, driver in DRIVERS.items()}  # fmt: skip
    torch.save(records, out)


def record(tmp: Path, tiny: str, overrides: list[str]) -> dict[str, Any]:
    cfg = compose_run(tmp, Path(tiny), "logger=none", "callbacks.checkpoint=null",
                      *overrides)  # fmt: skip
    module, datamodule, trainer, sandbox = build_run(cfg)
    llama = module.agents["tiny_llama"]
    llama.generator = ScriptedGenerator(llama.tokenizer, scripted_answer)
    steps: list[dict[str, Any]] = []
    make_batch = datamodule.make_batch

    def recorded(step: int) -> dict[str, Any]:
        batch = make_batch(step)
        steps.append({"step": step, "agents": batch["agents"],
                      "metrics": untimed(batch["metrics"])})  # fmt: skip
        return batch

    datamodule.make_batch = recorded
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    weights = {name: agent.policy.state_dict() for name, agent in module.agents.items()}
    return {"steps": steps, "logged": untimed(dict(trainer.callback_metrics)), "weights": weights}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
