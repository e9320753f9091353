"""The LiveCodeBench-format corpus: every candidate's verdict equals the one written down for it.

Problems are read by the real LiveCodeBench loader (so they get its default ``lcb`` profile) and
every candidate is graded through the real local sandbox and `Grader`, early-stopping like
LiveCodeBench. The expected verdicts come from lcb_runner's documented rules (see
tests/data/lcb_corpus/build.py); ``mars2`` overrides ``lcb`` only for the artefacts mars2
deliberately does not reproduce, each listed in README.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mars2.data.loaders import load_livecodebench
from mars2.data.problem import Problem
from mars2.sandbox.pool.local import LocalSandbox
from mars2.sandbox.records import Grade
from mars2.sandbox.verdict.grader import Grader

CORPUS = Path(__file__).parent / "data" / "lcb_corpus"
# Every class of difference issue 15 names, plus stdout comparison and LCB's own artefacts.
CLASSES = {"tests", "prelude", "call", "limits", "extraction", "stdout", "artefact"}


def _candidates() -> list[dict]:
    lines = (CORPUS / "candidates.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def corpus_box() -> Iterator[LocalSandbox]:
    # A whole-answer limit far below what the "long" problem needs (12 tests x 0.35 s): the lcb
    # profile must not apply it, as LiveCodeBench has none.
    box = LocalSandbox(num_workers=2, per_test_timeout=2.0, job_timeout=2.0)
    yield box
    box.close()


@pytest.fixture(scope="module")
def problems() -> dict[str, Problem]:
    return {p.id: p for p in load_livecodebench(CORPUS / "problems.jsonl")}


@pytest.fixture(scope="module")
def grades(corpus_box: LocalSandbox, problems: dict[str, Problem]) -> dict[str, Grade]:
    candidates = _candidates()
    graded = Grader(corpus_box, early_stop=True).grade(
        [(problems[c["problem"]], c["completion"]) for c in candidates]
    )
    return {c["id"]: g for c, g in zip(candidates, graded, strict=True)}


def test_corpus_covers_every_class_and_both_outcomes(problems: dict[str, Problem]) -> None:
    candidates = _candidates()
    assert {c["class"] for c in candidates} == CLASSES
    for cls in CLASSES - {"artefact"}:
        outcomes = {c["lcb"] for c in candidates if c["class"] == cls}
        assert outcomes == {"pass", "fail"}, cls
    assert all(p.metadata["grading_profile"] == "lcb" for p in problems.values())
    kinds = {p.test_kind.value for p in problems.values()}
    assert kinds == {"stdin", "call"}


@pytest.mark.parametrize("candidate", _candidates(), ids=lambda c: c["id"])
def test_candidate_verdict(candidate: dict, grades: dict[str, Grade]) -> None:
    grade = grades[candidate["id"]]
    expected = candidate.get("mars2", candidate["lcb"])
    got = "pass" if grade.private_passed else "fail"
    detail = [
        (t.verdict.value, t.actual[:60], t.error[-200:]) for t in grade.public + grade.private
    ]
    assert got == expected, f"{candidate['why']}: {detail}"


def test_lenient_profile_differs_where_lcb_is_stricter_or_looser(
    corpus_box: LocalSandbox, problems: dict[str, Problem]
) -> None:
    # The same answers under the lenient profile: what the lcb profile changed.
    by_id = {c["id"]: c for c in _candidates()}
    pick = {
        "prelude": next(c for c in by_id.values() if c["why"].startswith("List comes")),
        "float": next(c for c in by_id.values() if c["why"].startswith("exact ==")),
        "cpp": next(c for c in by_id.values() if c["why"] == "the language tag is ignored"),
        "long": next(c for c in by_id.values() if c["problem"] == "long"),
    }
    lenient = Grader(corpus_box, early_stop=True, profile="lenient").grade(
        [(problems[c["problem"]], c["completion"]) for c in pick.values()]
    )
    got = {name: g.private_passed for name, g in zip(pick, lenient, strict=True)}
    assert got == {"prelude": False, "float": True, "cpp": False, "long": False}
