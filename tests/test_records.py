"""One record from sampler to loss: a node holds its completion and grade, a sample its node."""

from __future__ import annotations

import json
from pathlib import Path

from mars2.generation.base import Completion
from mars2.rewards.routing import AdvantageConfig, route_samples
from mars2.sandbox.base import Verdict
from mars2.sandbox.records import Grade, TestFeedback
from mars2.search.simulated import simulated_problems
from mars2.search.tree import Node, SearchTree, load_trees, save_trees


def _tree() -> SearchTree:
    tree = SearchTree.new(simulated_problems(1)[0])
    for index, verdict in enumerate((Verdict.PASSED, Verdict.TIMEOUT)):
        tree.add(
            0,
            "a" if index == 0 else "b",
            completion=Completion("x", [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], truncated=index == 1),
            grade=Grade(
                code="print(1)",
                public=[TestFeedback(verdict, "1", "2", "3", "")],
                private=[TestFeedback(verdict, "4", "5", "6", "boom")],
                reward=1.0 if verdict is Verdict.PASSED else 0.0,
            ),
        )
    return tree


def test_node_reads_from_its_grade_and_completion() -> None:
    tree = _tree()
    good, bad = tree.nodes[1], tree.nodes[2]
    assert good.reward == 1.0 and good.private_passed and good.public_pass_rate == 1.0
    assert bad.reward == 0.0 and not bad.private_passed and bad.public_pass_rate == 0.0
    assert bad.truncated and not good.truncated and good.code == "print(1)"


def test_saved_verdicts_are_enum_values_and_load_back_as_the_enum(tmp_path: Path) -> None:
    tree = _tree()
    save_trees([tree], tmp_path / "t.jsonl")
    raw = json.loads((tmp_path / "t.jsonl").read_text())
    assert raw["nodes"][2]["grade"]["public"][0]["verdict"] == "timeout"
    (loaded,) = load_trees(tmp_path / "t.jsonl")
    assert loaded == tree
    assert loaded.nodes[2].grade.private[0].verdict is Verdict.TIMEOUT


def test_sample_is_its_node_plus_shaped_reward_and_advantage() -> None:
    tree = _tree()
    routed = route_samples([tree], ["a", "b"], AdvantageConfig(filter_degenerate=False))
    (sample,) = routed["b"]
    assert sample.node is tree.nodes[2] and sample.agent == "b" and sample.node_id == 2
    assert sample.advantage < 0 < routed["a"][0].advantage


def test_trees_saved_before_the_record_change_still_load() -> None:
    old = {
        "id": 1, "parent": 0, "depth": 1, "agent": "a", "messages": [], "completion": "```x```",
        "prompt_token_ids": [1], "token_ids": [2, 3], "logprobs": None, "code": "x",
        "feedback": [{"verdict": "wrong_answer", "input": "1", "expected": "2", "actual": "3",
                      "error": ""}],
        "private_passed": True, "public_pass_rate": 0.0, "reward": 1.0, "truncated": True,
        "children": [], "step": 3,
    }  # fmt: skip
    node = Node.from_dict(old)
    assert node.completion == Completion("```x```", [1], [2, 3], None, True)
    assert node.grade.public == [TestFeedback(Verdict.WRONG_ANSWER, "1", "2", "3", "")]
    assert node.private_passed and node.public_pass_rate == 0.0 and node.reward == 1.0
    assert node.step == 3 and node.code == "x"
    root = Node.from_dict({"id": 0, "parent": None, "depth": 0, "completion": "", "code": None})
    assert root.is_root and not root.private_passed and root.grade.private == []
