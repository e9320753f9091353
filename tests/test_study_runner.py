"""The study runner and analysis on stand-in jobs (tests/fakes/study_jobs.py): caching, resume,
failed runs recorded without stopping the others, analysis reproducible from runs.jsonl; and the
study file's validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mars2.study.analysis import analyse, load_runs
from mars2.study.runner import plan, run_study
from mars2.study.spec import StudyError, load_study

STUDY = {
    "name": "tiny",
    "task": {"data": "skills", "layout": "study", "agents": {"tiny_qwen3": "add",
                                                             "tiny_llama": "mul"}},
    "seeds": [1, 2, 3],
    "validation_seeds": [9],
    "settings": {"steps": 2, "problems_per_step": 2, "lr": 1e-4, "temperature": 1.0,
                 "max_new_tokens": 8, "warm_epochs": 1, "check_samples": 1, "test_samples": 1,
                 "eval_nodes": 2},
    "arms": [
        {"name": "P", "members": ["tiny_qwen3", "tiny_llama"], "search": "mars2", "nodes": 4,
         "gamma": 0.5},
        {"name": "G", "per_agent": True, "search": "grpo", "nodes": 4, "gamma": 0.0},
    ],
    "evaluations": [{"name": "team_P", "agents": ["P/tiny_qwen3", "P/tiny_llama"]},
                    {"name": "team_warm", "agents": ["warm/tiny_qwen3", "warm/tiny_llama"]}],
    "hypotheses": {
        "primary": [{"id": "H1", "a": "P/tiny_qwen3:pass1", "b": "G/tiny_qwen3:pass1"},
                    {"id": "H2", "a": "team_P:mcts", "b": "team_warm:mcts"}],
        "secondary": [{"id": "S1", "a": "P/tiny_llama:gain", "b": "G/tiny_llama:gain"}],
    },
    "manipulation": ["G/tiny_qwen3:gain", "G/tiny_llama:gain"],
    "analysis": {"alpha": 0.05, "margin": 0.03, "level": 0.95},
}  # fmt: skip


@pytest.fixture
def study_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(STUDY))
    return path


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "ran.log"
    monkeypatch.setenv("MARS2_STUDY_FAKE_LOG", str(log))
    monkeypatch.delenv("MARS2_STUDY_FAKE_FAIL", raising=False)
    return log


def _ran(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _run(study_file: Path, tmp_path: Path, seeds: list[int] | None = None) -> list[dict]:
    study = load_study(study_file)
    return run_study(study, seeds or study.seeds, tmp_path / "out", tmp_path / "work", jobs=2,
                     progress=False, module="tests.fakes.study_jobs")  # fmt: skip


def test_plan_has_every_job_per_seed(study_file: Path) -> None:
    jobs = plan(load_study(study_file), [1])
    kinds = [j.kind for j in jobs]
    # 2 warm starts; P + G per agent = 3 trainings; 2 warm + 2 P + 2 G samples + 2 A/A; 2 trees
    assert kinds.count("warm") == 2 and kinds.count("train") == 3
    assert kinds.count("sample") == 8 and kinds.count("tree") == 2
    assert len({j.id for j in jobs}) == len(jobs)


def test_runs_are_cached_and_a_rerun_does_nothing(study_file: Path, tmp_path: Path,
                                                  fake: Path) -> None:  # fmt: skip
    records = _run(study_file, tmp_path)
    assert all(r["error"] is None for r in records)
    first = _ran(fake)
    assert len(first) == len(records) == 3 * 15
    _run(study_file, tmp_path)
    assert _ran(fake) == first  # nothing ran again
    # Changed settings: every job's key changes, so everything runs again.
    changed = {**STUDY, "settings": {**STUDY["settings"], "steps": 3}}
    study_file.write_text(yaml.safe_dump(changed))
    _run(study_file, tmp_path)
    assert len(_ran(fake)) == 2 * len(first)


def test_resume_runs_only_what_is_missing(study_file: Path, tmp_path: Path, fake: Path) -> None:
    _run(study_file, tmp_path, seeds=[1])  # as if stopped after seed 1
    assert len(_ran(fake)) == 15
    for cached in (tmp_path / "work" / "cache").glob("tree__team_P__seed1.json"):
        cached.unlink()  # as if stopped during this job
    _run(study_file, tmp_path)
    ran = _ran(fake)
    assert len(ran) == 15 + 1 + 2 * 15
    assert ran[15] == "tree/tree/team_P/seed1" or "tree/tree/team_P/seed1" in ran[15:]


def test_a_failed_run_is_recorded_and_the_others_go_on(study_file: Path, tmp_path: Path,
                                                       fake: Path, monkeypatch) -> None:  # fmt: skip
    monkeypatch.setenv("MARS2_STUDY_FAKE_FAIL", "train/G/tiny_qwen3/seed2")
    records = _run(study_file, tmp_path)
    failed = {r["id"]: r["error"] for r in records if r["error"] is not None}
    assert "fake failure" in failed["train/G/tiny_qwen3/seed2"]
    assert "needs failed job" in failed["sample/G/tiny_qwen3/seed2"]
    assert set(failed) == {"train/G/tiny_qwen3/seed2", "sample/G/tiny_qwen3/seed2"}
    lines = (tmp_path / "out" / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 45 and sum('"error": null' not in line for line in lines) == 2
    summary = analyse(load_study(study_file), load_runs(tmp_path / "out" / "runs.jsonl"))
    h1 = next(c for c in summary["comparisons"] if c["id"] == "H1")
    assert h1["seeds"] == [1, 3] and h1["missing_seeds"] == [2]
    assert summary["failed_runs"] == sorted(failed)
    # The failure is not cached: a rerun without it runs exactly the two failed jobs.
    monkeypatch.delenv("MARS2_STUDY_FAKE_FAIL")
    before = len(_ran(fake))
    records = _run(study_file, tmp_path)
    assert all(r["error"] is None for r in records) and len(_ran(fake)) == before + 2


def test_analysis_from_raw_runs_is_exact_and_reproducible(study_file: Path, tmp_path: Path,
                                                          fake: Path) -> None:  # fmt: skip
    _run(study_file, tmp_path)
    study = load_study(study_file)
    runs = load_runs(tmp_path / "out" / "runs.jsonl")
    summary = analyse(study, runs)
    assert json.dumps(summary, sort_keys=True) == json.dumps(analyse(study, runs), sort_keys=True)
    by_id = {c["id"]: c for c in summary["comparisons"]}
    # Trained (0.4 + seed part) minus trained: 0 in every seed; team_P - team_warm: +0.1 each.
    assert by_id["H1"]["mean"] == pytest.approx(0.0)
    assert by_id["H2"]["mean"] == pytest.approx(0.1)
    assert by_id["H2"]["sign_flip_p"] == pytest.approx(1 / 8)
    assert by_id["H2"]["holm_p"] == pytest.approx(2 / 8)  # smaller of two p's, x 2
    assert by_id["H2"]["verdict"] == "inconclusive"  # 0.25 > 0.05: n = 3 cannot reach it
    checks = summary["manipulation"]["checks"]
    assert [c["mean"] for c in checks] == pytest.approx([0.1, 0.1])
    assert summary["aa"]["tiny_qwen3"]["mean"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seeds": [1, 9]}, "also validation seeds"),
        ({"hypotheses": {"primary": [{"id": "X", "a": "Q/tiny_qwen3:pass1",
                                       "b": "G/tiny_qwen3:pass1"}]}}, "measure"),
        ({"hypotheses": {"primary": []}}, "primary is empty"),
        ({"arms": [{"name": "warm", "per_agent": True, "search": "grpo", "nodes": 4,
                    "gamma": 0.0}]}, "reserved"),
    ],
)  # fmt: skip
def test_a_bad_study_file_is_refused(tmp_path: Path, change: dict, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**STUDY, **change}))
    with pytest.raises(StudyError, match=message):
        load_study(path)


def test_collect_writes_the_finished_runs_and_runs_nothing(study_file: Path, tmp_path: Path,
                                                           fake: Path) -> None:  # fmt: skip
    _run(study_file, tmp_path, seeds=[1])
    study = load_study(study_file)
    records = run_study(study, study.seeds, tmp_path / "out", tmp_path / "work", jobs=2,
                        progress=False, module="tests.fakes.study_jobs", collect_only=True)  # fmt: skip
    assert len(_ran(fake)) == 15 and len(records) == 15
    assert {r["seed"] for r in records} == {1}
    assert len((tmp_path / "out" / "runs.jsonl").read_text().splitlines()) == 15
    # Collecting takes finished jobs of another code version too (a run started before a commit).
    import mars2.study.runner as runner

    real = runner.code_version
    try:
        runner.code_version = lambda: "another-version"  # type: ignore[assignment]
        again = run_study(study, study.seeds, tmp_path / "out", tmp_path / "work", jobs=2,
                          progress=False, module="tests.fakes.study_jobs", collect_only=True)  # fmt: skip
    finally:
        runner.code_version = real
    assert len(again) == 15 and len(_ran(fake)) == 15


def test_sample_streams_and_chunks_get_their_own_seeds() -> None:
    from mars2.study.jobs import sampling_seed

    seeds = {sampling_seed(1000, stream, chunk) for stream in ("test/a", "test-aa/a", "test/b")
             for chunk in range(3)}  # fmt: skip
    assert len(seeds) == 9  # the A/A stream must not replay the test stream (it once did)
    assert sampling_seed(1000, "test/a", 1) == sampling_seed(1000, "test/a", 1)
