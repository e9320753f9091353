"""The installed console scripts work from any directory (configs ship with the package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _script(name: str) -> str:
    path = BIN / name
    if not path.exists():  # an interpreter outside the venv: fall back to PATH
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"{name} is not installed (pip install -e .)")
        return found
    return str(path)


def _run(command: list[str], cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_extra}
    env.pop("MARS2_ROOT", None)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_train_script_prints_the_job_config_from_another_directory(tmp_path: Path) -> None:
    result = _run([_script("mars2-train"), "--cfg", "job", "experiment=tiny_pair"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "experiment_name: tiny_pair" in result.stdout and "tiny_llama" in result.stdout
    assert "_target_: mars2.training.rollout.RolloutEngine" in result.stdout
    assert not list(tmp_path.iterdir())  # --cfg writes nothing


def test_eval_script_help_lists_the_config_groups(tmp_path: Path) -> None:
    result = _run([_script("mars2-eval"), "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "eval is powered by Hydra" in result.stdout
    assert "experiment: " in result.stdout and "tiny_pair" in result.stdout
    assert "samples: 4" in result.stdout  # eval.yaml's own settings


def test_eval_script_composes_an_experiment(tmp_path: Path) -> None:
    result = _run(
        [_script("mars2-eval"), "--cfg", "job", "experiment=areal14b_pair", "eval.limit=3"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "areal_boba2_14b" in result.stdout and "limit: 3" in result.stdout
    assert "callbacks" not in result.stdout  # training callbacks stay out of eval


def test_user_config_dir_is_added_with_hydra_searchpath(tmp_path: Path) -> None:
    mine = tmp_path / "my_configs" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - tiny_pair\nexperiment_name: mine\nsteps: 3\n"
    )
    result = _run(
        [
            _script("mars2-train"),
            "--cfg",
            "job",
            "experiment=mine",
            f"hydra.searchpath=[file://{tmp_path / 'my_configs'}]",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "experiment_name: mine" in result.stdout and "steps: 3" in result.stdout


def test_bad_override_fails_with_one_paragraph_not_a_traceback(tmp_path: Path) -> None:
    result = _run([_script("mars2-train"), "experiment=tiny_pair", "trainer=nope"], tmp_path)
    assert result.returncode == 1
    assert "trainer=nope" in result.stderr and "cpu, ddp, default, fsdp, gpu" in result.stderr
    assert "Traceback" not in result.stderr


def test_module_entry_points_match_the_scripts(tmp_path: Path) -> None:
    result = _run([sys.executable, "-m", "mars2.cli.eval", "--help"], tmp_path)
    assert result.returncode == 0 and "eval is powered by Hydra" in result.stdout
    checkout = _run(
        [sys.executable, str(REPO / "src/mars2/train.py"), "--cfg", "job", "experiment=tiny_pair"],
        tmp_path,
    )
    assert checkout.returncode == 0, checkout.stderr
    assert "experiment_name: tiny_pair" in checkout.stdout


@pytest.mark.slow
def test_scripts_from_a_regular_wheel_install(tmp_path: Path) -> None:
    """Build the wheel from a copy of the checkout, install it apart from the checkout and run the
    installed scripts with the checkout out of reach (its configs can only come from the wheel)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("src", "configs"):
        shutil.copytree(
            REPO / name,
            source / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )
    dist, site = tmp_path / "dist", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q"]
    built = _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), "."], source)
    assert built.returncode == 0, built.stderr
    wheel = next(dist.glob("mars2-*.whl"))
    installed = _run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stderr
    shutil.rmtree(source)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)}
    env.pop("MARS2_ROOT", None)
    where = subprocess.run(
        [sys.executable, "-c", "import mars2.configs; print(mars2.configs.__file__)"],
        capture_output=True, text=True, env=env, cwd=elsewhere,
    )  # fmt: skip
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    for script, args, expected in (
        ("mars2-train", ["--cfg", "job", "experiment=tiny_pair"], "experiment_name: tiny_pair"),
        ("mars2-eval", ["--help"], "eval is powered by Hydra"),
    ):
        result = subprocess.run(
            [str(site / "bin" / script), *args],
            capture_output=True, text=True, env=env, cwd=elsewhere, timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout


# --- one error style: exit status 1, one paragraph, no traceback, no folder left behind -----------


def _refused(result: subprocess.CompletedProcess, logs: Path) -> str:
    """The command failed the way every check of ours fails; returns its message."""
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert len(output.splitlines()) <= 8, output
    runs = logs / "train" / "runs", logs / "eval" / "runs"
    left = [p for root in runs if root.exists() for p in root.rglob("*") if p.is_dir()]
    assert not [p for p in left if p.parent.parent in runs], left  # no run folder made
    return output


def test_missing_checkpoint_is_one_paragraph(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = _run([_script("mars2-train"), "ckpt_path=/nonexistent.ckpt", f"paths.log_dir={logs}"],
                  tmp_path)  # fmt: skip
    assert "ckpt_path=/nonexistent.ckpt: no such checkpoint" in _refused(result, logs)
    again = _run([_script("mars2-train"), "resume=true", f"paths.log_dir={logs}"], tmp_path)
    assert "resume=true found no run" in _refused(again, logs)
    debug = _run([_script("mars2-train"), "ckpt_path=/nonexistent.ckpt", f"paths.log_dir={logs}",
                  "--debug"], tmp_path)  # fmt: skip
    assert debug.returncode != 0 and "Traceback" in debug.stderr  # --debug shows where


def test_misspelt_setting_names_the_nearest_one_before_anything_loads(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    added = _run([_script("mars2-eval"), "data=humaneval", "+eval.limt=2", f"paths.log_dir={logs}"],
                 tmp_path)  # fmt: skip
    assert "did you mean eval.limit?" in _refused(added, logs)
    plain = _run([_script("mars2-eval"), "data=humaneval", "eval.limt=2", f"paths.log_dir={logs}"],
                 tmp_path)  # fmt: skip
    text = _refused(plain, logs)
    assert "did you mean eval.limit?" in text and "+eval.limt" not in text  # no "use +key" advice
    trainer = _run([_script("mars2-train"), "+trainer.max_stepz=2", f"paths.log_dir={logs}"],
                   tmp_path)  # fmt: skip
    assert "did you mean trainer.max_steps?" in _refused(trainer, logs)


def test_keys_users_may_add_are_accepted(tmp_path: Path) -> None:
    result = _run(
        [_script("mars2-train"), "--cfg", "job", "+trainer.gradient_clip_val=1.0",
         "+agents.tiny_qwen3.generation.vllm.enforce_eager=true", "+my_note=hello"],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "gradient_clip_val: 1.0" in result.stdout and "enforce_eager: true" in result.stdout
    data = _run([_script("mars2-eval"), "--cfg", "job", "data=humaneval", "+data.eval.limit=3"],
                tmp_path)  # fmt: skip
    assert data.returncode == 0, data.stderr  # load_humaneval takes a limit


def test_empty_data_file_is_one_paragraph(tmp_path: Path) -> None:
    logs, empty = tmp_path / "logs", tmp_path / "empty.jsonl"
    empty.write_text("")
    result = _run([_script("mars2-eval"), "data=livecodebench", f"data.eval.path={empty}",
                   f"paths.log_dir={logs}"], tmp_path)  # fmt: skip
    text = _refused(result, logs)
    assert str(empty) in text and "selected no problems" in text


def test_unknown_agent_lists_the_agents(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = _run([_script("mars2-train"), "agent=[tiny_qwen3,tiny_mistral]",
                   f"paths.log_dir={logs}"], tmp_path)  # fmt: skip
    text = _refused(result, logs)
    assert "tiny_mistral" in text and "tiny_llama" in text and "qwen3_8b" in text


@pytest.mark.slow
def test_a_failure_after_the_folder_exists_leaves_no_empty_folder(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = _run([_script("mars2-train"), "experiment=tiny_pair", "warm_start=null",
                   "agents.tiny_qwen3.model.path=/nonexistent/model", f"paths.log_dir={logs}"],
                  tmp_path)  # fmt: skip
    text = _refused(result, logs)
    assert "/nonexistent/model" in text
    assert text.splitlines()[0].startswith("Run folder: ")  # the folder was made, then removed
    evaluated = _run([_script("mars2-eval"), "experiment=tiny_pair", "eval.limit=1",
                      "eval.allow_untrained=true", "agents.tiny_llama.model.path=/nonexistent/model",
                      f"paths.log_dir={logs}"],
                     tmp_path)  # fmt: skip
    assert "/nonexistent/model" in _refused(evaluated, logs)
    assert not (logs / "mlflow").exists()  # and no MLflow run was started for them


def test_memory_tool_help_and_bad_overrides(tmp_path: Path) -> None:
    helped = _run([sys.executable, "-m", "mars2.training.memory", "--help"], tmp_path)
    assert helped.returncode == 0 and "memory.gpu" in helped.stdout
    bad = _run([sys.executable, "-m", "mars2.training.memory", "memory.gpu=h900"], tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "h900" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_tree_viewer_screenshot_without_chromium_ends_cleanly(tmp_path: Path) -> None:
    from mars2.data.toy import toy_problems
    from mars2.search.tree import SearchTree, save_trees

    trees = tmp_path / "trees.jsonl"
    save_trees([SearchTree.new(toy_problems()[0])], trees)
    bare = tmp_path / "bin"  # a PATH where no browser is found
    bare.mkdir()
    command = [sys.executable, str(REPO / "scripts/view_tree.py"), str(trees),
               "--screenshot", str(tmp_path / "t.png"), "--no-open"]  # fmt: skip
    result = _run(command, tmp_path, PATH=str(bare))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "Chromium" in result.stderr and list((tmp_path / "trees").glob("*.html"))
    missing = _run([sys.executable, str(REPO / "scripts/view_tree.py"), "nope.jsonl"], tmp_path)
    assert missing.returncode == 1 and "no such trees file" in missing.stderr
    helped = _run([sys.executable, str(REPO / "scripts/view_tree.py"), "--help"], tmp_path)
    assert (
        helped.returncode == 0
        and "--screenshot" in helped.stdout
        and "best answer" in helped.stdout
    )
