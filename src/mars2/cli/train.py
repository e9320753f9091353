"""``mars2-train experiment=tiny_pair [overrides]`` (also ``python -m mars2.cli.train``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from mars2.cli import CONFIG_PATH, run_command
from mars2.cli.errors import reported


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def _main(cfg: DictConfig) -> float | None:
    with reported(cfg.paths.output_dir):
        from mars2.training.run import train

        metrics = train(cfg)
    return metrics.get("solve_rate")


def main() -> None:
    """Train the configured team (Hydra command line)."""
    run_command("train", _main)


if __name__ == "__main__":
    main()
