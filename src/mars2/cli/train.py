"""``mars2-train experiment=tiny_pair [overrides]`` (also ``python -m mars2.cli.train``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from mars2.cli import CONFIG_PATH, default_root


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def _main(cfg: DictConfig) -> float | None:
    from mars2.training.run import train

    metrics = train(cfg)
    return metrics.get("solve_rate")


def main() -> None:
    """Train the configured team (Hydra command line)."""
    default_root()
    _main()


if __name__ == "__main__":
    main()
