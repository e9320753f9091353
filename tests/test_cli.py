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


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MARS2_ROOT", None)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=180)


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


def test_bad_override_fails_with_hydra_error_not_a_traceback(tmp_path: Path) -> None:
    result = _run([_script("mars2-train"), "experiment=tiny_pair", "trainer=nope"], tmp_path)
    assert result.returncode != 0
    assert "Could not find 'trainer/nope'" in result.stderr and "Traceback" not in result.stderr


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
