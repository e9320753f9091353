"""GPU trainer configs set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (issue #43, point 5).

No GPU here: the variable is checked in the environment, not in a CUDA allocator.
"""

from __future__ import annotations

import pytest

from mars2.training.memory import (
    ALLOC_CONF_ENV,
    apply_allocator_conf,
    compose,
    trainer_arguments,
)


@pytest.mark.parametrize("trainer", ["gpu", "ddp", "fsdp"])
def test_gpu_trainers_export_expandable_segments(
    trainer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    cfg = compose(["experiment=tiny_pair", f"trainer={trainer}"])
    assert apply_allocator_conf(cfg) == "expandable_segments:True"
    import os

    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:True"
    assert "cuda_alloc_conf" not in trainer_arguments(cfg.trainer)  # not a Trainer argument
    assert trainer_arguments(cfg.trainer)["_target_"] == "lightning.pytorch.Trainer"


def test_cpu_runs_and_the_environment_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    cpu = compose(["experiment=tiny_pair", "trainer=fsdp", "trainer.accelerator=cpu"])
    assert apply_allocator_conf(cpu) is None
    monkeypatch.setenv(ALLOC_CONF_ENV, "max_split_size_mb:512")
    assert apply_allocator_conf(compose(["experiment=tiny_pair", "trainer=gpu"])) == (
        "max_split_size_mb:512"
    )
