"""Tree-consistent reward shaping: credit a node for its gain over its parent and its siblings."""

from __future__ import annotations

from mars2.search.tree import SearchTree


def baseline(tree: SearchTree, node_id: int, lam: float) -> float | None:
    """b_v = (1 - λ)·r_parent + λ·mean(raw rewards of v's siblings), leave-one-out.

    Depth-1 nodes have no parent answer: their baseline is the sibling mean alone. A node without
    siblings uses its parent's reward alone. A lone depth-1 node has no baseline (None).
    """
    node = tree.nodes[node_id]
    siblings = tree.siblings(node_id)
    sibling_mean = sum(s.reward for s in siblings) / len(siblings) if siblings else None
    if node.depth == 1:
        return sibling_mean
    assert node.parent is not None
    parent_reward = tree.nodes[node.parent].reward
    if sibling_mean is None:
        return parent_reward
    return (1.0 - lam) * parent_reward + lam * sibling_mean


def shape_rewards(tree: SearchTree, gamma: float = 0.5, lam: float = 0.5) -> dict[int, float]:
    """r̃_v = r_v + γ·(r_v − b_v) for every answer node; baselines use raw rewards only."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError("lam must be in [0, 1]")
    shaped = {}
    for node in tree.answers():
        b = baseline(tree, node.id, lam)
        shaped[node.id] = node.reward if b is None else node.reward + gamma * (node.reward - b)
    return shaped
