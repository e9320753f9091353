"""Problem sources as Hydra targets: each returns a list of problems for a config's train / eval slot."""

from __future__ import annotations

from mars2.data.problem import Problem
from mars2.data.toy import split_problems, toy_problems


def toy(part: str = "train", holdout_every: int = 5, seed: int = 0) -> list[Problem]:
    """The bundled toy set, its train part or its held-out part."""
    train, held = split_problems(toy_problems(seed=seed), holdout_every)
    if part == "train":
        return train
    if part in ("held_out", "eval"):
        return held
    if part == "all":
        return train + held
    raise ValueError(f"unknown toy part {part!r}: use 'train', 'held_out' or 'all'")
