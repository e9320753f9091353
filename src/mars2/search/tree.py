"""One search tree per problem: the root is the problem, every other node one agent's graded answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mars2.data.problem import Problem
from mars2.generation.base import Completion, Messages
from mars2.sandbox.base import Verdict
from mars2.sandbox.records import Grade, TestFeedback
from mars2.utils.atomic import atomic_open

ROOT_ID = 0


def _no_answer() -> Completion:
    return Completion(text="")


def _ungraded() -> Grade:
    return Grade(code=None)


@dataclass
class Node:
    """An agent's answer: the sampled completion and its grade (the root has neither).

    `reward` is the grade's reward (binary or pass rate, in [0, 1]) and is never changed
    afterwards: the search statistics and the shaping read it; length terms such as the overlong
    penalty live on the training sample (`mars2.rewards.routing.Sample.length_term`).
    """

    id: int
    parent: int | None
    depth: int
    agent: str | None = None
    messages: Messages = field(default_factory=list)
    completion: Completion = field(default_factory=_no_answer)
    grade: Grade = field(default_factory=_ungraded)
    reward: float = 0.0
    children: list[int] = field(default_factory=list)
    step: int | None = None  # training step that produced it, when known

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def code(self) -> str | None:
        """The code extracted from the answer (None: no parsable code block)."""
        return self.grade.code

    @property
    def private_passed(self) -> bool:
        return self.grade.private_passed

    @property
    def public_pass_rate(self) -> float:
        return self.grade.public_pass_rate

    @property
    def truncated(self) -> bool:
        return self.completion.truncated

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Node:
        fields = _from_flat(data) if isinstance(data.get("completion"), str) else dict(data)
        fields["completion"] = Completion(**fields["completion"])
        grade = dict(fields["grade"])
        for part in ("public", "private"):
            grade[part] = [
                TestFeedback(**{**f, "verdict": Verdict(f["verdict"])}) for f in grade[part]
            ]
        fields["grade"] = Grade(**grade)
        return cls(**fields)


def _from_flat(data: dict[str, Any]) -> dict[str, Any]:
    """A node as trees were saved before nodes held their completion and grade.

    Those files kept public feedback but no private one: the private part becomes a single
    verdict that says whether the private tests passed.
    """
    keep = ("id", "parent", "depth", "agent", "messages", "reward", "children", "step")
    fields = {key: data[key] for key in keep if key in data}
    fields["completion"] = {
        "text": data["completion"],
        "prompt_token_ids": data.get("prompt_token_ids", []),
        "token_ids": data.get("token_ids", []),
        "logprobs": data.get("logprobs"),
        "truncated": data.get("truncated", False),
    }
    passed = Verdict.PASSED if data.get("private_passed") else Verdict.WRONG_ANSWER
    has_code = data.get("code") is not None
    fields["grade"] = {
        "code": data.get("code"),
        "public": [{**f, "error": f.get("error") or ""} for f in data.get("feedback", [])],
        "private": [{"verdict": passed, "input": "", "expected": "", "actual": "", "error": ""}]
        if has_code
        else [],
        "reward": data.get("reward", 0.0),
    }
    return fields


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

    def add(
        self,
        parent: int,
        agent: str,
        *,
        completion: Completion | None = None,
        grade: Grade | None = None,
        messages: Messages | None = None,
        reward: float | None = None,
        step: int | None = None,
    ) -> Node:
        """Append `agent`'s answer as a child of `parent`; its id is the creation index.

        The reward defaults to the grade's.
        """
        parent_node = self.nodes[parent]
        grade = grade or _ungraded()
        node = Node(
            id=len(self.nodes),
            parent=parent,
            depth=parent_node.depth + 1,
            agent=agent,
            messages=messages or [],
            completion=completion or _no_answer(),
            grade=grade,
            reward=grade.reward if reward is None else reward,
            step=step,
        )
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
        return {"problem": self.problem.to_dict(), "nodes": [n.to_dict() for n in self.nodes]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchTree:
        return cls(
            problem=Problem.from_dict(data["problem"]),
            nodes=[Node.from_dict(n) for n in data["nodes"]],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> SearchTree:
        return cls.from_dict(json.loads(text))


def save_trees(trees: list[SearchTree], path: str | Path) -> None:
    """Write trees as jsonl (one tree a line), atomically: readers never see a torn file."""
    with atomic_open(path, "w", encoding="utf-8") as handle:
        for tree in trees:
            handle.write(tree.to_json() + "\n")


def load_trees(path: str | Path) -> list[SearchTree]:
    """Read trees written by `save_trees`."""
    with open(path, encoding="utf-8") as handle:
        return [SearchTree.from_json(line) for line in handle if line.strip()]
