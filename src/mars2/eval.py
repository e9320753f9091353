"""Evaluation entry point: ``python src/mars2/eval.py experiment=... ckpt_path=...`` (or ``mars2-eval``)."""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

os.environ.setdefault("MARS2_ROOT", str(Path(__file__).resolve().parents[2]))


@hydra.main(version_base="1.3", config_path="../../configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    from mars2.eval.run import evaluate

    evaluate(cfg)


if __name__ == "__main__":
    main()
