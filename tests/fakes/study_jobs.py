"""Cheap stand-ins for `mars2.study.jobs` (the runner's tests): no models, instant results.

Each job appends its id to ``$MARS2_STUDY_FAKE_LOG`` (so a test sees which jobs ran) and fails
when its id contains ``$MARS2_STUDY_FAKE_FAIL``; ``$MARS2_STUDY_FAKE_SLEEP`` seconds per job.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def worker_init() -> None:
    pass


def _log(label: str) -> None:
    time.sleep(float(os.environ.get("MARS2_STUDY_FAKE_SLEEP", "0")))
    fail = os.environ.get("MARS2_STUDY_FAKE_FAIL")
    if fail and fail in label:
        raise RuntimeError(f"fake failure of {label}")
    with open(os.environ["MARS2_STUDY_FAKE_LOG"], "a") as f:
        f.write(label + "\n")


def warm_job(task: dict[str, Any], s: dict[str, Any], agent: str, seed: int,
             target: str) -> dict[str, Any]:  # fmt: skip
    _log(f"warm/{agent}/seed{seed}")
    Path(target).mkdir(parents=True, exist_ok=True)
    return {"weights": target, "check_pass@1": 0.5, "losses": [1.0, 0.1], "epochs": 2,
            "wall_seconds": 0.0, "cpu_seconds": 0.0, "sandbox_cpu_seconds": 0.0}  # fmt: skip


def train_job(task: dict[str, Any], s: dict[str, Any], arm: dict[str, Any], seed: int,
              warm: dict[str, str], target: str) -> dict[str, Any]:  # fmt: skip
    _log(f"train/{arm['arm']}/{'+'.join(arm['members'])}/seed{seed}")
    steps = [{"step": 0, "wall_seconds": 0.0,
              "agents": {m: {"nodes": {"add": 4}, "tokens": 10} for m in arm["members"]}}]  # fmt: skip
    return {"weights": {m: f"{target}/{m}" for m in arm["members"]}, "steps": steps,
            "wall_seconds": 1.0, "cpu_seconds": 1.0, "sandbox_cpu_seconds": 0.0}  # fmt: skip


def _score(weights: str, seed: int) -> float:
    # Trained weights score 0.1 above warm ones, plus a seed-dependent part.
    return 0.3 + 0.01 * (seed % 7) + (0.0 if "/warm/" in weights else 0.1)


def sample_job(task: dict[str, Any], s: dict[str, Any], weights: str, agent: str, seed: int,
               stream: str, part: str) -> dict[str, Any]:  # fmt: skip
    _log(f"sample/{weights}/{stream}")
    value = _score(weights, seed) + (0.01 if stream != "test" else 0.0)
    block = {"pass@1": value, "flat_public": value, "flat_vote": value}
    return {**block, "groups": {"add": block}, "rows": []}


def tree_job(task: dict[str, Any], s: dict[str, Any], weights: dict[str, str], seed: int,
             stream: str, part: str) -> dict[str, Any]:  # fmt: skip
    _log(f"tree/{stream}/seed{seed}")
    value = sum(_score(w, seed) for w in weights.values()) / len(weights)
    return {"pass@1(mcts)": value, "pass@N": value, "groups": {}, "nodes": {}}
