"""Shared fixtures: one local sandbox per session, tiny models built once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mars2.sandbox.pool.local import LocalSandbox

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def sandbox() -> Iterator[LocalSandbox]:
    box = LocalSandbox(num_workers=2, per_test_timeout=2.0, job_timeout=20.0)
    yield box
    box.close()


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny agents: those `make` built (MARS2_TINY_MODELS), else built here once."""
    from mars2.models.tiny import make_tiny_models

    given = os.environ.get("MARS2_TINY_MODELS")
    target = Path(given) if given else tmp_path_factory.mktemp("tiny_models")
    make_tiny_models(target)
    return target
