"""Where one tiny_pair training step spends its wall time; target: < 10% outside the model work.

Model work = generation, sandbox grading and the policies' forward/backward passes. Everything else
(search bookkeeping, prompt building, reward shaping, batching, optimizer steps, Lightning,
logging, tree saving) is overhead. Degenerate trees are kept so that every step trains.

    python benchmarks/bench_overhead.py --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra import compose, initialize_config_dir

from mars2.models.tiny import make_tiny_models
from mars2.training.run import build_run

REPO = Path(__file__).resolve().parents[1]


class _StepTimer(pl.Callback):
    """Wall time of whole steps (rollout included: it happens inside training_step)."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.rollouts: list[dict[str, float]] = []

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self.began = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.walls.append(time.perf_counter() - self.began)
        self.rollouts.append(dict(trainer.datamodule.last.metrics))


def _time_forward_backward(module: Any, spent: list[float]) -> None:
    """Wrap each agent's loss (forward) and the module's backward to add their time to `spent`."""
    for agent in module.agents.values():
        original = agent.compute_loss

        def timed_loss(batch: Any, _original: Any = original) -> Any:
            began = time.perf_counter()
            out = _original(batch)
            spent[-1] += time.perf_counter() - began
            return out

        agent.compute_loss = timed_loss
    original_backward = module.manual_backward

    def timed_backward(loss: Any, *a: Any, **k: Any) -> None:
        began = time.perf_counter()
        original_backward(loss, *a, **k)
        spent[-1] += time.perf_counter() - began

    module.manual_backward = timed_backward


def run(steps: int) -> dict[str, float]:
    tiny = Path(os.environ.get("MARS2_TINY_MODELS", REPO / ".cache" / "tiny_models"))
    make_tiny_models(tiny)
    with (
        tempfile.TemporaryDirectory() as out,
        initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"),
    ):
        cfg = compose(config_name="train", overrides=[
            "experiment=tiny_pair", f"paths.tiny_models_dir={tiny}", f"paths.output_dir={out}",
            f"paths.log_dir={out}/logs", f"steps={steps + 1}", "advantage.filter_degenerate=false",
            "~callbacks.progress", "+trainer.enable_progress_bar=false",
        ])  # fmt: skip
        module, datamodule, trainer, sandbox = build_run(cfg)
        timer = _StepTimer()
        trainer.callbacks.append(timer)
        fwd_bwd = [0.0]

        class _NewStep(pl.Callback):
            def on_train_batch_end(self, *a: Any, **k: Any) -> None:
                fwd_bwd.append(0.0)

        trainer.callbacks.insert(0, _NewStep())
        _time_forward_backward(module, fwd_bwd)
        try:
            trainer.fit(module, datamodule=datamodule)
        finally:
            sandbox.close()
    rows = []
    for wall, rollout, model in zip(
        timer.walls[1:], timer.rollouts[1:], fwd_bwd[1:], strict=False
    ):  # first step: warm-up
        generation, grading = rollout["generation_seconds"], rollout["grading_seconds"]
        rows.append({"wall": wall, "generation": generation, "grading": grading, "forward_backward": model,
                     "overhead": wall - generation - grading - model})  # fmt: skip
    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    summary["overhead_share"] = summary["overhead"] / summary["wall"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="timed steps (one more runs as warm-up)"
    )
    result = run(parser.parse_args().steps)
    print("tiny_pair training step (median of timed steps)")
    for key in ("wall", "generation", "grading", "forward_backward", "overhead"):
        print(f"  {key:17} {result[key]:7.3f} s  ({result[key] / result['wall']:6.1%})")
    print(f"  overhead share {result['overhead_share']:.1%} (target < 10%)")


if __name__ == "__main__":
    main()
