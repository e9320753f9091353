"""`generation.backend=reference`: a data file and the grader checked end to end with known-good
answers, each traced to its problem by id; and what an evaluation prints and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars2.data.problem import Problem, TestCase, TestKind
from mars2.eval.run import answer_key
from mars2.generation.reference import AnswerKeyError, ReferenceGenerator
from mars2.search.prompts import PromptBuilder


def _problem(pid: str, statement: str, solution: str) -> Problem:
    return Problem(
        id=pid, statement=statement, test_kind=TestKind.STDIN,
        public_tests=(TestCase("1\n", "1\n"),), private_tests=(TestCase("1\n", "1\n"),),
        metadata={"reference_solution": solution},
    )  # fmt: skip


def test_answers_are_traced_to_the_problem_id_not_a_statement_substring() -> None:
    # The statement of `short` is part of `long`'s: matching by substring (the old
    # OracleGenerator) answered `long`'s prompts with `short`'s solution.
    short = _problem("short", "Print the sum", "print('short')")
    long = _problem("long", "Print the sum of the squares", "print('long')")
    generator = ReferenceGenerator(answer_key([short, long]))
    prompts = PromptBuilder()
    chats = [prompts.fresh_messages(long), prompts.fresh_messages(short)]
    texts = [c.text for c in generator.generate(chats)]
    assert "print('long')" in texts[0] and "print('short')" in texts[1]


def test_a_refinement_prompt_is_traced_to_its_problem() -> None:
    from mars2.search.tree import SearchTree

    short = _problem("short", "Print the sum", "print('short')")
    long = _problem("long", "Print the sum of the squares", "print('long')")
    tree = SearchTree.new(long)
    tree.add(0, agent="a")
    chat = PromptBuilder().refine_messages(long, tree.nodes[1])
    key = answer_key([short, long])
    assert key.problem_id(chat) == "long"


def test_problems_the_backend_cannot_answer_are_refused() -> None:
    bare = Problem(id="bare", statement="x", test_kind=TestKind.STDIN,
                   public_tests=(TestCase("1", "1"),), private_tests=())  # fmt: skip
    with pytest.raises(AnswerKeyError, match=r"ship no reference solution \(first: bare"):
        answer_key([bare])
    twins = [_problem("a", "Same", "print(1)"), _problem("b", "Same", "print(2)")]
    with pytest.raises(AnswerKeyError, match="same prompt but different reference solutions"):
        answer_key(twins)
    with pytest.raises(LookupError, match="prompt of no problem"):
        answer_key(twins[:1]).problem_id([{"role": "user", "content": "something else"}])


def test_reference_solutions_of_loaded_rows_are_kept(tmp_path: Path) -> None:
    from mars2.data.loaders import load_deepcoder

    path = tmp_path / "rows.jsonl"
    row = {"id": "p1", "prompt": "Echo.", "reference_solution": "print(input())",
           "label": {"inputs": ["1"], "outputs": ["1"]}}  # fmt: skip
    path.write_text(json.dumps(row) + "\n")
    (problem,) = load_deepcoder(path)
    assert problem.metadata["reference_solution"] == "print(input())"


# --- the command, as a user runs it -------------------------------------------------------------


def _eval(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MARS2_ROOT", None)
    command = [sys.executable, "-m", "mars2.cli.eval", "experiment=tiny_pair",
               f"paths.log_dir={tmp_path}/logs", *overrides]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)  # fmt: skip


def test_reference_backend_scores_one_on_humaneval_and_describes_its_output(
    tmp_path: Path,
) -> None:
    result = _eval(tmp_path, "data=humaneval", "generation.backend=reference", "eval.limit=20")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    folder = Path(lines[0].removeprefix("Run folder: "))
    assert lines[0].startswith("Run folder: ") and folder.is_dir()
    report = json.loads((folder / "results.json").read_text())
    summaries = report["settings"]
    assert (
        report["run"]["weights"] == "none (reference solutions)"
        and report["run"]["dataset"] == "humaneval"
    )
    assert {s["name"] for s in summaries} == {
        "tiny_qwen3", "tiny_llama", "tiny_qwen3+tree", "tiny_llama+tree", "team+tree"
    }  # fmt: skip
    for summary in summaries:
        for metric, value in summary["metrics"].items():
            assert value == 1.0, (summary["name"], metric)
    # The table says what its numbers are of; the paths written come last.
    assert any("20 problems of humaneval" in line and "n=4" in line and "60 nodes" in line
               for line in lines)  # fmt: skip
    wrote = lines.index("Wrote:")
    assert all(str(folder) in line or "MLflow" in line for line in lines[wrote + 1 :])
    assert str(folder / "results.json") in result.stdout
    console = result.stdout + result.stderr
    for noise in ("💡", "Loading weights", "not found. Creating it", "Creating initial MLflow"):
        assert noise not in console
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/logs/mlflow/mlflow.db")
    experiment = client.get_experiment_by_name("mars2-eval")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == f"eval/tiny_pair/{folder.name}/humaneval"


@pytest.mark.slow
def test_eval_resume_with_other_settings_reuses_nothing_and_says_so(tmp_path: Path) -> None:
    small = ["data=toy", "generation.backend=reference", "eval.tree_budget=2", "logger=none"]
    first = _eval(tmp_path, *small, "eval.samples=1", "eval.limit=2")
    assert first.returncode == 0, first.stderr[-3000:]
    first_dir = Path(first.stdout.splitlines()[0].removeprefix("Run folder: "))
    second = _eval(tmp_path, *small, "eval.samples=2", "eval.limit=3", "resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    second_dir = Path(second.stdout.splitlines()[0].removeprefix("Run folder: "))
    assert second_dir != first_dir  # a new run: none of the first run's rows are reused
    said = second.stdout + second.stderr
    assert "eval.samples (1 -> 2)" in said and "eval.limit (2 -> 3)" in said
    rows = (second_dir / "results" / "tiny_qwen3_sampling.jsonl").read_text().splitlines()
    assert len(rows) == 3 and all(json.loads(r)["n"] == 2 for r in rows)
    assert len((first_dir / "results" / "tiny_qwen3_sampling.jsonl").read_text().splitlines()) == 2
    refused = _eval(tmp_path, *small, "eval.samples=2", f"resume={first_dir}")
    output = (refused.stdout + refused.stderr).strip()
    assert refused.returncode == 1 and "Traceback" not in output and len(output.splitlines()) <= 8
    assert "eval.samples (1 -> 2)" in output
    again = _eval(tmp_path, *small, "eval.samples=1", "eval.limit=2", "resume=true")
    assert again.returncode == 0 and again.stdout.startswith(f"Run folder: {first_dir}")
