"""Turn scored trees into per-agent training samples, routed by the name of the agent that made them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from mars2.rewards.advantages import GroupBy, group_advantages, is_degenerate
from mars2.rewards.shaping import shape_rewards
from mars2.search.tree import Node, SearchTree

# A reward term of the completion's length in tokens, e.g. `mars2.rewards.overlong.OverlongPenalty`.
LengthTerm = Callable[[int], float]


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages (defaults follow the MARS² paper).

    ``ddof``: 0 normalises by the population std, 1 by the sample std (``torch.std``, MARTI's
    choice, which it pairs with ``eps=1e-9``).
    """

    gamma: float = 0.5
    lam: float = 0.5
    scale_std: bool = True
    group_by: GroupBy = "tree"
    eps: float = 1e-6
    filter_degenerate: bool = True
    ddof: int = 0

    def __post_init__(self) -> None:
        if self.ddof not in (0, 1):
            raise ValueError(
                f"advantage ddof must be 0 (population std) or 1 (sample std), got {self.ddof}"
            )
        if self.eps < 0:
            raise ValueError("advantage eps must be >= 0")


@dataclass(frozen=True)
class Sample:
    """One node as a training example for the agent that generated it.

    The node holds the completion (tokens, sampling log-probs) and the grade; the sample adds
    where the node sits in the step's batch, its shaped reward (from raw rewards only), the length
    term its agent adds to it (DAPO's overlong penalty, 0 or negative) and its advantage.
    """

    node: Node
    tree_index: int
    shaped_reward: float
    advantage: float
    length_term: float = 0.0

    @property
    def agent(self) -> str:
        assert self.node.agent is not None, "the root is never a sample"
        return self.node.agent

    @property
    def node_id(self) -> int:
        return self.node.id


def tree_samples(
    tree: SearchTree,
    tree_index: int,
    config: AdvantageConfig,
    length_terms: Mapping[str, LengthTerm] | None = None,
) -> list[Sample]:
    """Samples for every answer of a tree (none when the tree is degenerate and filtered).

    Filtering and shaping see the raw grade rewards only; each node's length term
    (`length_terms[agent]` of its completion's token count) then joins its shaped reward, and the
    group normalises the sums: MARTI's order (tree shaping in its processor, the overlong penalty
    and the group normalisation in its advantage step) and DAPO's (the length term is a reward).
    """
    if len(tree) == 0 or (config.filter_degenerate and is_degenerate(tree)):
        return []
    original = {n.id: n for n in tree.nodes}
    origin = {n.id: n.id for n in tree.nodes}
    if any(node.grade.infra_error for node in tree.answers()):
        tree, origin = graded_only(tree)  # answers our infrastructure failed to grade: no one's
        if len(tree) == 0 or (config.filter_degenerate and is_degenerate(tree)):
            return []
    shaped = shape_rewards(tree, config.gamma, config.lam)
    terms = length_terms or {}
    length: dict[int, float] = {}
    for node in tree.answers():
        term = terms.get(node.agent or "")
        length[node.id] = 0.0 if term is None else float(term(len(node.completion.token_ids)))
    scored = {node_id: shaped[node_id] + length[node_id] for node_id in shaped}
    advantages = group_advantages(
        tree, scored, config.scale_std, config.group_by, config.eps, config.ddof
    )
    return [
        Sample(
            original[origin[node.id]], tree_index, shaped[node.id], advantages[node.id],
            length[node.id],
        )
        for node in tree.answers()
    ]  # fmt: skip


def graded_only(tree: SearchTree) -> tuple[SearchTree, dict[int, int]]:
    """The tree without the answers whose grade is an infrastructure error (and without their
    descendants, whose prompts showed that grade's feedback): their rewards say nothing about
    the answers, so they shape no baseline, join no group and train nobody. Also returns each
    kept node's id in the original tree."""
    dropped: set[int] = set()
    for node in tree.answers():
        if node.grade.infra_error or node.parent in dropped:
            dropped.add(node.id)
    kept = [n for n in tree.nodes if n.id not in dropped]
    renumber = {n.id: i for i, n in enumerate(kept)}
    nodes = [
        replace(
            n,
            id=renumber[n.id],
            parent=None if n.parent is None else renumber[n.parent],
            children=[renumber[c] for c in n.children if c in renumber],
        )
        for n in kept
    ]
    return SearchTree(tree.problem, nodes), {i: n.id for i, n in enumerate(kept)}


def route_samples(
    trees: Sequence[SearchTree],
    agents: Iterable[str],
    config: AdvantageConfig | None = None,
    length_terms: Mapping[str, LengthTerm] | None = None,
) -> dict[str, list[Sample]]:
    """Samples per agent name; every team member gets a key, empty when it produced nothing.

    A node made by an agent outside the team is an error, never silently given to someone else.
    `length_terms` as in `tree_samples`.
    """
    config = config or AdvantageConfig()
    routed: dict[str, list[Sample]] = {name: [] for name in agents}
    for index, tree in enumerate(trees):
        for sample in tree_samples(tree, index, config, length_terms):
            if sample.agent not in routed:
                raise KeyError(
                    f"node {sample.node_id} of tree {index} comes from unknown agent {sample.agent!r}"
                )
            routed[sample.agent].append(sample)
    return routed
