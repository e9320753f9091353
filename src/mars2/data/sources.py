"""Problem sources as Hydra targets: each returns a list of problems for a config's train / eval slot."""

from __future__ import annotations

import random

from mars2.data.problem import Problem
from mars2.data.skills import skill_parts
from mars2.data.toy import arithmetic_problems, split_problems, toy_problems


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


def arithmetic(part: str = "train", seed: int = 0) -> list[Problem]:
    """The learning demo's problems in three disjoint parts: warm_start, train and held_out.

    A seeded shuffle puts 20% in the supervised warm start, 20% held out and the rest in RL.
    """
    problems = arithmetic_problems(seed=seed)
    order = random.Random(seed).sample(range(len(problems)), len(problems))
    fifth = len(problems) // 5
    parts = {
        "warm_start": order[:fifth],
        "held_out": order[fifth : 2 * fifth],
        "train": order[2 * fifth :],
    }
    if part not in parts:
        raise ValueError(f"unknown arithmetic part {part!r}: use {sorted(parts)}")
    return [problems[i] for i in sorted(parts[part])]


def skills(part: str = "train", seed: int = 0, layout: str = "suite") -> list[Problem]:
    """Two-skill arithmetic (see `mars2.data.skills`): ``warm_start_add``, ``warm_start_mul``,
    ``train`` or ``held_out``, all disjoint; with ``layout="study"`` ``validation`` and ``test``
    instead of ``held_out``. Each seed draws its own split."""
    parts = skill_parts(seed, layout=layout)
    if part not in parts:
        raise ValueError(f"unknown skills part {part!r}: use {sorted(parts)}")
    return parts[part]
