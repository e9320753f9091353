"""Turn scored trees into per-agent training samples, routed by the name of the agent that made them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mars2.rewards.advantages import GroupBy, group_advantages, is_degenerate
from mars2.rewards.shaping import shape_rewards
from mars2.search.tree import Node, SearchTree


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages (defaults follow the MARS² paper)."""

    gamma: float = 0.5
    lam: float = 0.5
    scale_std: bool = True
    group_by: GroupBy = "tree"
    eps: float = 1e-6
    filter_degenerate: bool = True


@dataclass(frozen=True)
class Sample:
    """One node as a training example for the agent that generated it.

    The node holds the completion (tokens, sampling log-probs) and the grade; the sample adds
    where the node sits in the step's batch and its shaped reward and advantage.
    """

    node: Node
    tree_index: int
    shaped_reward: float
    advantage: float

    @property
    def agent(self) -> str:
        assert self.node.agent is not None, "the root is never a sample"
        return self.node.agent

    @property
    def node_id(self) -> int:
        return self.node.id


def tree_samples(tree: SearchTree, tree_index: int, config: AdvantageConfig) -> list[Sample]:
    """Samples for every answer of a tree (none when the tree is degenerate and filtered)."""
    if len(tree) == 0 or (config.filter_degenerate and is_degenerate(tree)):
        return []
    shaped = shape_rewards(tree, config.gamma, config.lam)
    advantages = group_advantages(tree, shaped, config.scale_std, config.group_by, config.eps)
    return [
        Sample(node, tree_index, shaped[node.id], advantages[node.id]) for node in tree.answers()
    ]


def route_samples(
    trees: Sequence[SearchTree], agents: Iterable[str], config: AdvantageConfig | None = None
) -> dict[str, list[Sample]]:
    """Samples per agent name; every team member gets a key, empty when it produced nothing.

    A node made by an agent outside the team is an error, never silently given to someone else.
    """
    config = config or AdvantageConfig()
    routed: dict[str, list[Sample]] = {name: [] for name in agents}
    for index, tree in enumerate(trees):
        for sample in tree_samples(tree, index, config):
            if sample.agent not in routed:
                raise KeyError(
                    f"node {sample.node_id} of tree {index} comes from unknown agent {sample.agent!r}"
                )
            routed[sample.agent].append(sample)
    return routed
