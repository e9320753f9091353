"""Our commands silence Lightning's accelerator lines and adverts (`quiet_libraries`); the
trainer's own warnings still show."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest

from mars2.utils.logs import quiet_libraries


def test_lightning_accelerator_lines_are_silenced(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert any("GPU available:" in r.getMessage() for r in caplog.records)  # Lightning says it
    caplog.clear()
    quiet_libraries()
    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "available:" in m or "Tip" in m], said
