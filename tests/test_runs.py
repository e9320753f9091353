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
from mars2.utils.runs import RunFolderError, choose_run_dir, latest_checkpoint, resumable_run
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
    assert sorted(p.step for p in history) == [1, 2, 3, 4, 5, 6]  # every step, once
    for step in range(1, 7):
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
    # The resumed run trained, and its progress (one line per step without a terminal) knows the
    # total.
    assert "step 6/6" in console
    assert console.count("Seed set to 42") == 1  # one line per log message


@pytest.mark.slow
def test_ctrl_c_before_the_first_checkpoint_then_resume_continues_that_run(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    """Checkpoints every 5 steps; Ctrl-C during step 3 (of trainer.max_steps=10) writes last.ckpt
    at the last completed step, and resume=true continues this run (not an older one) to a
    last.ckpt that holds step 10, with every step once in MLflow. (A tiny step takes a fraction of
    a second: 7 steps of slack, so that a slow poll cannot let the run finish first.)"""
    logs = tmp_path / "logs"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    older = logs / "train" / "runs" / "tiny_pair" / "2000-01-01_00-00-00"  # a finished old run
    (older / "checkpoints").mkdir(parents=True)
    (older / "checkpoints" / "last.ckpt").write_bytes(b"not this one")
    os.utime(older / "checkpoints" / "last.ckpt", (1_000_000, 1_000_000))
    os.utime(older, (1_000_000, 1_000_000))
    command = [
        sys.executable, str(REPO / "src/mars2/train.py"), "experiment=tiny_pair", "data=arith",
        "warm_start.epochs=2", "trainer.max_steps=10", f"paths.log_dir={logs}",
        f"paths.tiny_models_dir={tiny_models_dir}", "sandbox.num_workers=1",
        "advantage.filter_degenerate=false", "problems_per_step=1", "search.config.max_nodes=2",
        "agents.tiny_qwen3.generation.max_new_tokens=12",
        "agents.tiny_llama.generation.max_new_tokens=12",
    ]  # fmt: skip
    # A terminal's Ctrl-C: the child's SIGINT at its default even where this process ignores it
    # (a background job of a non-interactive shell, `cmd &`, starts with SIGINT ignored, and an
    # ignored signal is inherited: Python would then never raise KeyboardInterrupt).
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    runs_root = logs / "train" / "runs" / "tiny_pair"
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and first.poll() is None:
            if list(runs_root.glob("2*/trees/step_000003_rank0.jsonl")):
                break  # step 3 is done: step 4 is running
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[0][-3000:]
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        console, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode != 0, console[-3000:]
    (folder,) = [p for p in runs_root.iterdir() if p != older]
    assert console.startswith(f"Run folder: {folder}")
    stopped = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)
    assert 3 <= stopped["global_step"] < 10  # the steps completed when Ctrl-C arrived
    assert (folder / "checkpoints" / "step_000005.ckpt").exists() == (stopped["global_step"] >= 5)
    assert "resume=true" in console and "Traceback" not in console

    second = subprocess.run([*command, "resume=true"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert second.returncode == 0, second.stderr[-4000:]
    assert sorted(runs_root.iterdir()) == sorted([older, folder])  # no third folder
    assert (older / "checkpoints" / "last.ckpt").read_bytes() == b"not this one"
    final = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)
    assert final["global_step"] == 10  # the end, not the last every-5-steps checkpoint
    for step in range(1, 11):
        assert (folder / "trees" / f"step_{step:06d}_rank0.jsonl").exists()
    client, (run,) = _mlflow_runs(logs)
    assert run.info.run_name == f"train/tiny_pair/{folder.name}"
    assert run.info.status == "FINISHED" and run.data.tags["mars2.resumes"] == "1"
    history = client.get_metric_history(run.info.run_id, "reward")
    assert sorted(p.step for p in history) == list(range(1, 11))  # every step once, in place
    warm = client.get_metric_history(run.info.run_id, "warm_start/tiny_qwen3/loss")
    assert sorted(p.step for p in warm) == [1, 2]  # the warm start's loss per epoch
    output = second.stdout + second.stderr
    assert second.stdout.startswith(f"Run folder: {folder}")
    assert f"{folder / 'checkpoints' / 'last.ckpt'} (step 10)" in second.stdout
    for noise in ("💡", "Loading weights", "Writing model shards", "not found. Creating it",
                  "Epoch 0"):  # fmt: skip
        assert noise not in output + console, noise


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
    with pytest.raises(RunFolderError, match="found no run with a checkpoint under"):
        choose_run_dir("train", None, True, str(tmp_path / "empty"), fresh)


def test_train_resume_skips_runs_without_a_checkpoint(tmp_path: Path) -> None:
    """A newer attempt that failed or was stopped before its first checkpoint is skipped (and
    named), never trained from step 0: resume=true takes the newest run that has a checkpoint;
    with none, or resume=<that folder>, it is refused."""
    root = tmp_path / "runs"
    finished = root / "2026-01-01_00-00-00"
    (finished / "checkpoints").mkdir(parents=True)
    (finished / "checkpoints" / "last.ckpt").write_bytes(b"x")
    os.utime(finished / "checkpoints" / "last.ckpt", (1_000_000, 1_000_000))
    os.utime(finished, (1_000_000, 1_000_000))
    failed = root / "2026-01-02_00-00-00"
    (failed / ".hydra").mkdir(parents=True)
    (failed / ".hydra" / "config.yaml").write_text("{}")
    (failed / "trees").mkdir()
    assert choose_run_dir("train", None, True, str(root), str(root / "new")) == str(finished)
    assert resumable_run(root) == (finished, [failed])
    with pytest.raises(RunFolderError, match="has no checkpoint"):
        choose_run_dir("train", None, str(failed), str(root), str(root / "new"))
    (finished / "checkpoints" / "last.ckpt").unlink()
    with pytest.raises(RunFolderError, match=r"no run with a checkpoint.*2026-01-02_00-00-00"):
        choose_run_dir("train", None, True, str(root), str(root / "new"))


def test_eval_resume_only_reuses_a_run_with_the_same_record(tmp_path: Path) -> None:
    from mars2.utils.runs import eval_record, write_record

    root = tmp_path / "logs" / "eval" / "runs" / "default"
    first_cfg = _compose("eval", tmp_path, "eval.samples=1", "eval.limit=2")
    first = root / "2026-01-01_00-00-00"
    (first / "results").mkdir(parents=True)
    (first / "results" / "a_sampling.jsonl").write_text('{"problem_id": "x"}\n')
    write_record(first, eval_record(first_cfg))
    fresh = str(root / "2026-01-02_00-00-00")
    same = _compose("eval", tmp_path, "eval.samples=1", "eval.limit=2")
    assert choose_run_dir("eval", None, True, str(root), fresh, same) == str(first)
    other = _compose("eval", tmp_path, "eval.samples=2", "eval.limit=3")
    assert choose_run_dir("eval", None, True, str(root), fresh, other) == fresh  # nothing reused
    with pytest.raises(RunFolderError) as caught:
        choose_run_dir("eval", None, str(first), str(root), fresh, other)
    text = _one_paragraph(caught.value)
    assert "eval.samples (1 -> 2)" in text and "eval.limit (2 -> 3)" in text
    # Other weights are other settings: the record holds the checkpoint's fingerprint.
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"weights one")
    with_ckpt = eval_record(_compose("eval", tmp_path, f"ckpt_path={ckpt}"))
    ckpt.write_bytes(b"weights two")
    assert with_ckpt != eval_record(_compose("eval", tmp_path, f"ckpt_path={ckpt}"))


def test_a_folder_of_rows_without_a_record_is_not_resumed(tmp_path: Path) -> None:
    from mars2.utils.runs import check_eval_folder

    old = tmp_path / "old"
    (old / "results").mkdir(parents=True)
    (old / "results" / "team_tree.jsonl").write_text('{"problem_id": "x"}\n')
    with pytest.raises(RunFolderError, match=r"no eval_record\.json"):
        check_eval_folder(old, {"seed": "1"}, "resume")
    check_eval_folder(tmp_path / "empty", {"seed": "1"}, "resume")  # nothing to mix: fine


def test_last_checkpoint_holds_the_final_step_between_intervals(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    checkpoint = AtomicModelCheckpoint(
        dirpath=folder, filename="step_{step:06d}", every_n_train_steps=5, save_last=True,
        save_top_k=-1, auto_insert_metric_name=False,
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=6, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(_Linear())
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_000005.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 6


class _TermedAt(_Linear):
    """Sends itself SIGTERM during one step, as a cluster's scheduler does."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def test_sigterm_between_intervals_finishes_the_step_and_checkpoints_it(tmp_path: Path) -> None:
    """SIGTERM during step 3 (checkpoints every 5): Lightning finishes the step, last.ckpt holds
    step 3 (not nothing), and a resume from it goes on to the end."""
    folder = tmp_path / "checkpoints"

    def trainer() -> pl.Trainer:
        checkpoint = AtomicModelCheckpoint(
            dirpath=folder, filename="step_{step:06d}", every_n_train_steps=5, save_last=True,
            save_top_k=-1, auto_insert_metric_name=False,
        )  # fmt: skip
        return pl.Trainer(
            max_steps=7, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
        )  # fmt: skip

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            trainer().fit(_TermedAt(2))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 3
    resumed = trainer()
    resumed.fit(_Linear(), ckpt_path=str(folder / "last.ckpt"))
    assert resumed.global_step == 7
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_000005.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 7


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
    assert f"{tmp_path}/data/livecodebench/release_v6.jsonl" in text
    assert "data.eval.path" in text and "mars2-data livecodebench" in text


def _lcb_row(qid: str, day: str) -> str:
    import json

    tests = json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}])
    return json.dumps({"question_id": qid, "question_content": "echo", "contest_date": day,
                       "public_test_cases": tests, "private_test_cases": tests})  # fmt: skip


def test_empty_eval_window_names_source_and_filter(tmp_path: Path) -> None:
    data = tmp_path / "data" / "livecodebench" / "release_v6.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(_lcb_row("a", "2024-03-01T00:00:00") + "\n")
    cfg = _compose("eval", tmp_path, "data=livecodebench")
    with pytest.raises(ConfigError) as caught:
        validate_eval_config(cfg)  # loads the problems: an empty selection stops here
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
    ("override", "named"),
    [
        ("agents.tiny_qwen3.generation.max_new_tokens=0",
         "agents.tiny_qwen3.generation (max_new_tokens=0)"),
        ("agents.tiny_llama.generation.temperature=0", "agents.tiny_llama.generation (temperature=0)"),
        ("agents.tiny_qwen3.generation.top_p=1.5", "agents.tiny_qwen3.generation (top_p=1.5)"),
        ("agents.tiny_qwen3.loss.eps_low=-0.1", "agents.tiny_qwen3.loss (beta=0.0, eps_low=-0.1"),
        ("steps=0", "steps=0"),
        ("search.config.max_nodes=0", "search.config (max_nodes=0"),
        # Ranges that only the dataclasses state (validation never restated them):
        ("agents.tiny_qwen3.optim.ppo_epochs=0", "agents.tiny_qwen3.optim (ppo_epochs=0"),
        ("search.config.policy.prior.alpha=0", "search.config.policy.prior (kind=beta, alpha=0,"),
        ("search.config.policy.max_depth=0", "search.config.policy (max_depth=0)"),
        ("problems_per_step=0", "problems_per_step must be >= 1"),
    ],
)  # fmt: skip
def test_out_of_range_settings_are_refused(tmp_path: Path, override: str, named: str) -> None:
    cfg = _compose("train", tmp_path, override)
    with pytest.raises(ConfigError) as caught:
        validate_train_config(cfg)
    assert named in _one_paragraph(caught.value)


def test_pipelined_driver_refuses_tensor_parallel_vllm_before_models_load(tmp_path: Path) -> None:
    tensor_parallel = ("agents.tiny_llama.generation.backend=vllm",
                       "+agents.tiny_llama.generation.vllm={tensor_parallel_size: 2}")  # fmt: skip
    cfg = _compose("train", tmp_path, "search.config.driver=pipelined", *tensor_parallel)
    with pytest.raises(ConfigError) as caught:
        validate_train_config(cfg)
    text = _one_paragraph(caught.value)
    assert "'tiny_llama'" in text and "tensor_parallel_size=2" in text
    assert "search.config.driver=rounds" in text
    validate_train_config(_compose("train", tmp_path, *tensor_parallel))  # the rounds driver: fine


def test_ranges_are_stated_once_in_the_dataclasses() -> None:
    """validation.py builds the settings dataclasses instead of restating their ranges."""
    source = (REPO / "src/mars2/utils/validation.py").read_text()
    for restated in ("eps_low", "top_p", "max_new_tokens", "tis_cap", "tree_budget"):
        assert restated not in source


def test_eval_settings_are_checked_by_their_dataclass(tmp_path: Path) -> None:
    for override, named in (("eval.samples=0", "eval (samples=0)"),
                            ("eval.temperature=0", "eval (temperature=0")):  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            validate_eval_config(_compose("eval", tmp_path, override))
        assert named in _one_paragraph(caught.value)


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


def test_a_run_that_fails_or_is_stopped_while_built_is_closed_truthfully(
    tmp_path: Path, monkeypatch
) -> None:
    """Params are logged before anything that can fail; an exception while the run is built
    (warm start included) ends it FAILED, SIGTERM ends it KILLED; the launch command is kept and
    each resume's command is appended."""
    from mars2.utils.tracking import closed_on_failure

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setattr(sys, "argv", ["mars2-train", "experiment=tiny_pair"])
    first = _tracker(tmp_path, run_dir)
    first.log_hyperparams({"seed": 1})
    with pytest.raises(RuntimeError), closed_on_failure(first):
        raise RuntimeError("No supported gpu backend found!")
    client = first.experiment
    run = client.get_run(first.run_id)
    assert run.info.status == "FAILED" and run.data.params == {"seed": "1"}

    monkeypatch.setattr(sys, "argv", ["mars2-train", "experiment=tiny_pair", "resume=true"])
    again = _tracker(tmp_path, run_dir)
    again.log_hyperparams({"seed": 1})  # as build_run does, before the warm start
    assert client.get_run(first.run_id).info.status == "RUNNING"
    with pytest.raises(SystemExit) as stop, closed_on_failure(again):
        os.kill(os.getpid(), signal.SIGTERM)  # during the warm start
        time.sleep(5)
    assert stop.value.code == 143
    run = client.get_run(first.run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["mars2.command"] == "mars2-train experiment=tiny_pair"
    assert run.data.tags["mars2.command_resume_1"] == "mars2-train experiment=tiny_pair resume=true"


def test_the_final_block_names_the_eval_command_of_its_checkpoint(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from mars2.training.run import eval_command

    cfg = OmegaConf.create({"experiment_name": "tiny_pair"})
    assert eval_command(cfg, tmp_path) is None  # no checkpoint: nothing to evaluate
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert eval_command(cfg, tmp_path) == f"mars2-eval experiment=tiny_pair ckpt_path={last}"


def test_a_finished_run_shows_a_short_table() -> None:
    from mars2.training.run import summary_table

    table = summary_table(3, {"reward": 0.5, "solve_rate": 0.25, "tiny_qwen3/loss": 0.125,
                              "tiny_qwen3/kl": 0.0, "grading_seconds": 1.0})  # fmt: skip
    assert table.splitlines() == [
        "finished at step 3; the last step:",
        "  reward           0.5000",
        "  solve_rate       0.2500",
        "  tiny_qwen3/loss  0.1250",
    ]


_SWEEP_NAMES = """
import hydra

from mars2.cli import CONFIG_PATH


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def main(cfg) -> None:  # each job of the sweep: the MLflow run name its logger would take
    print("RUN_NAME", hydra.utils.instantiate(cfg.logger)._run_name, flush=True)


main()
"""


def _sweep_run_names(tmp_path: Path, *overrides: str) -> list[str]:
    """The run names of a real ``-m`` sweep's jobs (Hydra's basic launcher, mars2's logger
    config; no job trains)."""
    script = tmp_path / "names.py"
    script.write_text(_SWEEP_NAMES)
    done = subprocess.run(
        [sys.executable, str(script), "-m", f"paths.log_dir={tmp_path}/logs", *overrides],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [
        line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("RUN_NAME ")
    ]


@pytest.mark.slow
def test_each_job_of_a_sweep_gets_its_own_run_name(tmp_path: Path) -> None:
    """Named by their overrides; still distinct when the overrides are long (MLflow keeps 250
    characters of a name) or Hydra's override_dirname leaves the swept key out."""
    names = _sweep_run_names(tmp_path, "experiment=tiny_pair", "seed=1,2")
    assert len(names) == 2 and names[0].startswith("train/tiny_pair/"), names
    assert names[0].endswith("seed=1") and names[1].endswith("seed=2")
    long = "x" * 300
    names = _sweep_run_names(
        tmp_path, "seed=1,2", f"+tag={long}_a,{long}_b",
        "hydra.job.config.override_dirname.exclude_keys=[seed]",
    )  # fmt: skip
    assert len(names) == 4 and len(set(names)) == 4, names
    assert all(len(name) <= 250 for name in names)
