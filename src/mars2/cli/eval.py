"""``mars2-eval experiment=tiny_pair [ckpt_path=...]`` (also ``python -m mars2.cli.eval``)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from mars2.cli import CONFIG_PATH, run_command
from mars2.cli.errors import reported


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def _main(cfg: DictConfig) -> None:
    with reported(cfg.paths.output_dir):
        from mars2.eval.run import evaluate

        evaluate(cfg)


def main() -> None:
    """Evaluate every agent alone and the team (Hydra command line)."""
    run_command("eval", _main)


if __name__ == "__main__":
    main()
