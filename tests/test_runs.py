"""Runs that behave: atomic checkpoints, resume into the same run folder and MLflow run, clear
errors for bad configs before any model loads."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader

from mars2.training.checkpoint import AtomicModelCheckpoint
from mars2.utils.atomic import WriteError, atomic_write_text
from mars2.utils.runs import RunFolderError, choose_run_dir, latest_checkpoint
from mars2.utils.tracking import metric_key
from mars2.utils.validation import (
    ConfigError,
    load_problem_set,
    validate_eval_config,
    validate_train_config,
)

REPO = Path(__file__).resolve().parents[1]


# --- atomic writes ------------------------------------------------------------------------------


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(64, 64), batch_size=4)


def _trainer(folder: Path, steps: int) -> pl.Trainer:
    checkpoint = AtomicModelCheckpoint(
        dirpath=folder, filename="step_{step:06d}", every_n_train_steps=1, save_last=True,
        save_top_k=-1, auto_insert_metric_name=False,
    )  # fmt: skip
    return pl.Trainer(
        max_steps=steps, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=folder,
    )  # fmt: skip


def test_checkpoint_write_failing_midway_leaves_previous_last_loadable(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    _trainer(folder, 2).fit(_Linear())
    last = folder / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 2

    trainer = _trainer(folder, 4)
    real_save = trainer.strategy.checkpoint_io.save_checkpoint

    def disk_full(checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        # A full disk cannot be made here without root: write the real bytes halfway, then fail
        # the way the kernel does (ENOSPC).
        real_save(checkpoint, path)
        size = os.path.getsize(path)
        with open(path, "r+b") as handle:
            handle.truncate(size // 2)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    trainer.strategy.checkpoint_io.save_checkpoint = disk_full  # type: ignore[method-assign]
    with pytest.raises(WriteError) as caught:
        trainer.fit(_Linear(), ckpt_path=str(last))
    message = str(caught.value)
    assert "needs" in message and " MB" in message and "full" in message
    state = torch.load(last, weights_only=False)  # complete, not the torn half
    assert state["global_step"] == 2
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary left


def test_atomic_text_write_keeps_old_file_on_failure(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "results.json"
    atomic_write_text(target, "old")

    def fail(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(WriteError, match=r"It needs 0\.0 MB"):
        atomic_write_text(target, "new" * 10)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


# --- resume into the same run ---------------------------------------------------------------------


def _train_command(logs: Path, tiny: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO / "src/mars2/train.py"), "experiment=tiny_pair", "debug=fast",
        "steps=6", "data=toy", f"paths.log_dir={logs}", f"paths.tiny_models_dir={tiny}",
        "sandbox.num_workers=1", "advantage.filter_degenerate=false", "problems_per_step=1",
        "search.config.max_nodes=2", "agents.tiny_qwen3.generation.max_new_tokens=12",
        "agents.tiny_llama.generation.max_new_tokens=12", *extra,
    ]  # fmt: skip


def _mlflow_runs(logs: Path) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{logs}/mlflow/mlflow.db")
    experiment = client.get_experiment_by_name("mars2-train")
    return client, client.search_runs([experiment.experiment_id])


@pytest.mark.slow
def test_killed_run_resumes_into_the_same_folder_and_mlflow_run(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    logs = tmp_path / "logs"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    first = subprocess.Popen(
        _train_command(logs, tiny_models_dir), cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    runs_root = logs / "train" / "runs" / "tiny_pair"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and first.poll() is None:
            checkpoints = list(runs_root.glob("*/checkpoints/step_*.ckpt"))
            if checkpoints:  # killed early: most steps are left for the resumed run
                break
            time.sleep(0.2)
        assert first.poll() is None, first.stderr.read().decode()[-3000:] if first.stderr else ""
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)  # no chance to clean up: like a crash
        first.wait()
    (folder,) = runs_root.iterdir()
    client, (run,) = _mlflow_runs(logs)
    assert run.info.status == "RUNNING"  # what a killed process leaves behind

    second = subprocess.run(
        _train_command(logs, tiny_models_dir, "resume=true"), cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-4000:]
    assert [p.name for p in runs_root.iterdir()] == [folder.name]  # one run folder
    _, runs = _mlflow_runs(logs)
    assert len(runs) == 1 and runs[0].info.run_id == run.info.run_id  # one MLflow run
    resumed = client.get_run(run.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert resumed.data.tags["mars2.resumes"] == "1"
    assert resumed.data.tags["mars2.attempt_0_ended"] == "KILLED"
    history = client.get_metric_history(run.info.run_id, "reward")
    assert sorted(p.step for p in history) == [0, 1, 2, 3, 4, 5]  # every step, once
    for step in range(6):
        assert (folder / "trees" / f"step_{step:06d}_rank0.jsonl").exists()
    assert (folder / "overview.png").exists()
    # Running means continue across the resume: the last one averages all six steps.
    key = "tiny_qwen3/reward_mean"
    values = [
        p.value
        for p in sorted(client.get_metric_history(run.info.run_id, key), key=lambda p: p.step)
    ]
    running = client.get_metric_history(run.info.run_id, f"{key}_running")
    final = max(running, key=lambda p: p.step).value
    assert final == pytest.approx(sum(values) / len(values), rel=1e-5)
    console = second.stdout + second.stderr
    assert "/6 [" in console  # the resumed run trained, and its bar knows the total
    assert console.count("Seed set to 42") == 1  # one line per log message


def test_run_folder_choice(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    fresh = str(root / "2026-01-01_00-00-00")
    assert choose_run_dir("train", None, False, str(root), fresh) == fresh
    run = root / "2025-12-31_00-00-00"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_000001.ckpt").write_bytes(b"x")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (run / "checkpoints" / ".last.ckpt.tmp").write_bytes(b"torn")
    assert latest_checkpoint(run) == run / "checkpoints" / "last.ckpt"
    ckpt = str(run / "checkpoints" / "step_000001.ckpt")
    assert choose_run_dir("train", ckpt, False, str(root), fresh) == str(run.resolve())
    assert choose_run_dir("train", None, True, str(root), fresh) == str(run)
    assert choose_run_dir("eval", ckpt, False, str(root), fresh) == fresh  # eval gets its own
    with pytest.raises(RunFolderError, match="no such checkpoint"):
        choose_run_dir("train", str(run / "nope.ckpt"), False, str(root), fresh)
    with pytest.raises(RunFolderError, match="found no run with a checkpoint"):
        choose_run_dir("train", None, True, str(tmp_path / "empty"), fresh)


def test_metric_names_are_mlflow_safe() -> None:
    assert metric_key("team+tree/pass@1(mcts)") == "team_tree/pass_at_1_mcts"
    assert metric_key("heldout/tiny_qwen3/pass@1") == "heldout/tiny_qwen3/pass_at_1"


# --- validation: one paragraph naming the cause, before any model loads ---------------------------


def _compose(task: str, tmp: Path, *overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(
            config_name=task,
            overrides=[
                f"paths.output_dir={tmp}", f"paths.log_dir={tmp}/logs",
                f"paths.data_dir={tmp}/data", *overrides,
            ],
        )  # fmt: skip


def _one_paragraph(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text.strip() and len(text) < 600
    return text


def test_missing_data_names_the_path_and_how_to_get_it(tmp_path: Path) -> None:
    cfg = _compose("eval", tmp_path, "data=livecodebench")
    with pytest.raises(ConfigError) as caught:
        validate_eval_config(cfg)
    text = _one_paragraph(caught.value)
    assert f"{tmp_path}/data/livecodebench/test6.jsonl" in text
    assert "data.eval.path" in text and "Download" in text


def _lcb_row(qid: str, day: str) -> str:
    import json

    tests = json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}])
    return json.dumps({"question_id": qid, "question_content": "echo", "contest_date": day,
                       "public_test_cases": tests, "private_test_cases": tests})  # fmt: skip


def test_empty_eval_window_names_source_and_filter(tmp_path: Path) -> None:
    data = tmp_path / "data" / "livecodebench" / "test6.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(_lcb_row("a", "2024-03-01T00:00:00") + "\n")
    cfg = _compose("eval", tmp_path, "data=livecodebench")
    validate_eval_config(cfg)
    with pytest.raises(ConfigError) as caught:
        load_problem_set(cfg, "eval")
    text = _one_paragraph(caught.value)
    assert "load_livecodebench" in text and "start_date=2025-01" in text
    assert "selected no problems" in text
    cfg = _compose("eval", tmp_path, "data=livecodebench", "data.eval.start_date=2024-01")
    assert len(load_problem_set(cfg, "eval")) == 1


def test_empty_training_set_names_the_source(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = _compose(
        "train", tmp_path, "data.train._target_=mars2.data.loaders.load_problems_jsonl",
        "~data.train.part", f"+data.train.path={empty}",
    )  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        load_problem_set(cfg, "train")
    text = _one_paragraph(caught.value)
    assert "data.train" in text and str(empty) in text and "selected no problems" in text


@pytest.mark.parametrize(
    ("override", "setting"),
    [
        ("agents.tiny_qwen3.generation.max_new_tokens=0", "generation.max_new_tokens=0"),
        ("agents.tiny_llama.generation.temperature=0", "generation.temperature=0"),
        ("agents.tiny_qwen3.generation.top_p=1.5", "generation.top_p=1.5"),
        ("agents.tiny_qwen3.loss.eps_low=-0.1", "loss.eps_low=-0.1"),
        ("steps=0", "steps=0"),
        ("search.config.max_nodes=0", "search.config.max_nodes=0"),
    ],
)
def test_out_of_range_settings_are_refused(tmp_path: Path, override: str, setting: str) -> None:
    cfg = _compose("train", tmp_path, override)
    with pytest.raises(ConfigError) as caught:
        validate_train_config(cfg)
    assert setting in _one_paragraph(caught.value)


def test_unwritable_run_folder_names_the_path_and_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(RunFolderError) as caught:
        choose_run_dir("train", None, False, str(tmp_path), str(blocker / "run"))
    text = _one_paragraph(caught.value)
    assert str(blocker / "run") in text and "hydra.run.dir" in text


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_run_folder_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    run.chmod(0o555)
    try:
        with pytest.raises(RunFolderError, match="not writable"):
            choose_run_dir("train", str(run / "checkpoints" / "last.ckpt"), False, "x", "y")
    finally:
        run.chmod(0o755)


def test_unwritable_hydra_run_dir_stops_with_one_line(tmp_path: Path, capsys) -> None:
    from omegaconf import OmegaConf

    from mars2.utils.runs import RunFolderCheck

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = OmegaConf.create({"hydra": {"run": {"dir": str(blocker / "run")}}})
    with pytest.raises(SystemExit):
        RunFolderCheck().on_run_start(config)
    message = capsys.readouterr().err
    assert str(blocker / "run") in message and "hydra.run.dir" in message
    RunFolderCheck().on_run_start(
        OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "ok")}}})
    )
    assert (tmp_path / "ok").is_dir() and not list((tmp_path / "ok").iterdir())


# --- MLflow run status ----------------------------------------------------------------------------


def _tracker(tmp_path: Path, run_dir: Path) -> Any:
    from mars2.utils.tracking import RunTracker

    return RunTracker(
        experiment_name="status", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        artifact_location=str(tmp_path / "artifacts"), run_dir=str(run_dir),
    )  # fmt: skip


def test_tracker_statuses_and_continuation(tmp_path: Path) -> None:
    from mars2.utils.tracking import tracked

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = _tracker(tmp_path, run_dir)
    first.log_hyperparams({"seed": 1})
    first.log_metrics({"team+tree/pass@1(mcts)": 0.5}, step=0)
    with pytest.raises(ValueError), tracked(first):
        raise ValueError("boom")
    client = first.experiment
    assert client.get_run(first.run_id).info.status == "FAILED"
    assert "team_tree/pass_at_1_mcts" in client.get_run(first.run_id).data.metrics

    again = _tracker(tmp_path, run_dir)  # same run folder: same MLflow run
    again.log_hyperparams({"seed": 2, "limit": 3})  # a changed param becomes a tag, no error
    again.log_metrics({"team+tree/pass@1(mcts)": 0.9, "other": 1.0}, step=0)
    with pytest.raises(KeyboardInterrupt), tracked(again):
        raise KeyboardInterrupt
    run = client.get_run(first.run_id)
    assert again.run_id == first.run_id and run.info.status == "KILLED"
    assert run.data.tags["mars2.resumes"] == "1" and run.data.tags["mars2.resumed.seed"] == "2"
    history = client.get_metric_history(first.run_id, "team_tree/pass_at_1_mcts")
    assert [p.value for p in history] == [0.5]  # step 0 once
    assert run.data.params == {"seed": "1", "limit": "3"}

    third = _tracker(tmp_path, run_dir)
    with tracked(third):
        third.log_metrics({"other": 2.0}, step=1)
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_runs_of_dead_processes_are_marked_killed(tmp_path: Path) -> None:
    from mars2.utils.tracking import mark_stale_runs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tracker = _tracker(tmp_path, tmp_path / "a")
    client = tracker.experiment
    stale = client.create_run(tracker.experiment_id)
    client.set_tag(stale.info.run_id, "mars2.pid", str(dead.pid))
    import socket

    client.set_tag(stale.info.run_id, "mars2.host", socket.gethostname())
    assert mark_stale_runs(client, tracker.experiment_id, keep=tracker.run_id) == [
        stale.info.run_id
    ]
    assert client.get_run(stale.info.run_id).info.status == "KILLED"
    assert client.get_run(tracker.run_id).info.status == "RUNNING"  # this process is alive


def test_compiling_graded_code_prints_no_warnings() -> None:
    import warnings

    from mars2.sandbox.verdict.extract import extract_code

    answer = "Here:\n```python\nimport re\nprint(re.findall('\\d+', input()))\n```"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning escaping to the console fails the test
        assert extract_code(answer) == "import re\nprint(re.findall('\\d+', input()))\n"
