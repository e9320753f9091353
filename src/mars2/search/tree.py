"""One search tree per problem: the root is the problem, every other node one agent's answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mars2.data.problem import Problem

ROOT_ID = 0


@dataclass
class Node:
    """An agent's full answer (or the root, which has no agent and no reward)."""

    id: int
    parent: int | None
    depth: int
    agent: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    completion: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    code: str | None = None
    feedback: list[dict[str, str]] = field(default_factory=list)
    private_passed: bool = False
    public_pass_rate: float = 0.0
    reward: float = 0.0
    truncated: bool = False
    children: list[int] = field(default_factory=list)
    step: int | None = None  # training step that produced it, when known

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass
class SearchTree:
    """Nodes indexed by creation order; node 0 is the root."""

    problem: Problem
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def new(cls, problem: Problem) -> SearchTree:
        return cls(problem=problem, nodes=[Node(id=ROOT_ID, parent=None, depth=0)])

    @property
    def root(self) -> Node:
        return self.nodes[ROOT_ID]

    def __len__(self) -> int:
        """Number of answer nodes (the root does not count)."""
        return len(self.nodes) - 1

    def answers(self) -> Iterator[Node]:
        """Every non-root node in creation order."""
        return iter(self.nodes[1:])

    def add(self, parent: int, **fields: Any) -> Node:
        """Append a child of `parent`; its id is the creation index."""
        parent_node = self.nodes[parent]
        node = Node(id=len(self.nodes), parent=parent, depth=parent_node.depth + 1, **fields)
        self.nodes.append(node)
        parent_node.children.append(node.id)
        return node

    def ancestors(self, node_id: int) -> Iterator[Node]:
        """The node's parent, grandparent, ... up to and including the root."""
        parent = self.nodes[node_id].parent
        while parent is not None:
            yield self.nodes[parent]
            parent = self.nodes[parent].parent

    def siblings(self, node_id: int) -> list[Node]:
        """Other children of the node's parent."""
        parent = self.nodes[node_id].parent
        if parent is None:
            return []
        return [self.nodes[c] for c in self.nodes[parent].children if c != node_id]

    @property
    def solved(self) -> bool:
        return any(node.private_passed for node in self.answers())

    # -- serialisation ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"problem": self.problem.to_dict(), "nodes": [asdict(n) for n in self.nodes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchTree:
        return cls(
            problem=Problem.from_dict(data["problem"]), nodes=[Node(**n) for n in data["nodes"]]
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> SearchTree:
        return cls.from_dict(json.loads(text))


def save_trees(trees: list[SearchTree], path: str | Path) -> None:
    """Write trees as jsonl (one tree a line)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for tree in trees:
            handle.write(tree.to_json() + "\n")


def load_trees(path: str | Path) -> list[SearchTree]:
    """Read trees written by `save_trees`."""
    with open(path, encoding="utf-8") as handle:
        return [SearchTree.from_json(line) for line in handle if line.strip()]
