"""Training entry point: ``python src/mars2/train.py experiment=tiny_pair`` (or ``mars2-train``)."""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

# Run from a checkout, `python src/mars2/train.py` finds configs/ two levels up; paths.root_dir
# defaults to that checkout so logs/ and .cache/ land inside it.
os.environ.setdefault("MARS2_ROOT", str(Path(__file__).resolve().parents[2]))


@hydra.main(version_base="1.3", config_path="../../configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from mars2.training.run import train

    metrics = train(cfg)
    return metrics.get("solve_rate")


if __name__ == "__main__":
    main()
