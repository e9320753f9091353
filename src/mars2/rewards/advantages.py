"""Path-level group advantages over a tree: every node of a tree (all agents, all depths) is one group."""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import numpy as np

from mars2.search.tree import SearchTree

GroupBy = Literal["tree", "depth"]


def is_degenerate(tree: SearchTree) -> bool:
    """True when every answer has the same raw reward: the tree carries no learning signal."""
    rewards = {node.reward for node in tree.answers()}
    return len(rewards) <= 1


def group_advantages(
    tree: SearchTree,
    shaped: dict[int, float],
    scale_std: bool = True,
    group_by: GroupBy = "tree",
    eps: float = 1e-6,
    ddof: int = 0,
) -> dict[int, float]:
    """A_v = (r̃_v − mean) / (std + ε) within the group.

    ``ddof=0`` is the population std, ``ddof=1`` the sample std (``torch.std``'s default, which
    MARTI uses with ε = 1e-9); a group too small for it (one node with ``ddof=1``) has std 0.
    ``scale_std=False`` gives Dr. GRPO's unscaled A_v = r̃_v − mean; ``group_by="depth"`` groups
    the nodes of each depth separately.
    """
    if group_by not in ("tree", "depth"):
        raise ValueError(f"unknown group_by {group_by!r}: use 'tree' or 'depth'")
    groups: dict[int, list[int]] = defaultdict(list)
    for node in tree.answers():
        groups[node.depth if group_by == "depth" else 0].append(node.id)
    advantages: dict[int, float] = {}
    for members in groups.values():
        values = np.array([shaped[m] for m in members], dtype=np.float64)
        centred = values - values.mean()
        if scale_std:
            std = values.std(ddof=ddof) if len(values) > ddof else 0.0
            centred = centred / (std + eps)
        for member, value in zip(members, centred, strict=True):
            advantages[member] = float(value)
    return advantages
