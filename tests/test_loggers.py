"""Other Lightning loggers are a config choice away: `logger=tensorboard` writes event files into
the run folder; a logger whose package is missing is refused before the run starts, in one
paragraph naming the install."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars2.cli.errors import user_errors
from mars2.cli.preflight import preflight
from mars2.utils.runs import register_resolver

register_resolver()
SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_a_logger_without_its_package_is_one_paragraph(tmp_path: Path, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(  # the package is absent (it may be installed here)
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(user_errors()) as caught:
        preflight("train", ["experiment=tiny_pair", "logger=wandb", f"paths.log_dir={tmp_path}"])
    assert "pip install '.[wandb]'" in str(caught.value) and "logger=mlflow" in str(caught.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(
    not any(importlib.util.find_spec(p) for p in ("tensorboard", "tensorboardX")),
    reason="needs tensorboard or tensorboardX (pip install '.[tensorboard]')",
)
def test_logger_tensorboard_writes_event_files(tmp_path: Path, tiny_models_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1",
           "MARS2_TINY_MODELS": str(tiny_models_dir)}  # fmt: skip
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "mars2.cli.train", "experiment=tiny_pair", "debug=fast", "steps=1",
         "logger=tensorboard", f"hydra.run.dir={run}", f"paths.log_dir={tmp_path / 'logs'}"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((run / "tensorboard").rglob("events.out.tfevents.*")), sorted(run.rglob("*"))
    assert not (tmp_path / "logs" / "mlflow").exists()
