"""Scratch directories for sandbox jobs, made and removed without `tempfile` or `shutil`.

The sandbox worker imports this instead of those modules: with what they pull in (bz2, lzma,
random, ...) they would make every fork of the worker slower.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def make_private_dir(parent: str, prefix: str) -> str:
    """Create a new directory only its owner can enter, with an unguessable name."""
    for _ in range(100):
        path = os.path.join(parent, prefix + os.urandom(8).hex())
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a fresh directory under {parent}")


def _quietly(remove: Callable[[str], None], target: str) -> None:
    try:
        remove(target)
    except OSError:
        pass


def remove_tree(path: str, keep_top: bool = False) -> None:
    """Delete what can be deleted under `path` (and `path` unless `keep_top`); never follows links."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            _quietly(os.unlink, os.path.join(root, name))
        for name in dirs:
            target = os.path.join(root, name)
            _quietly(os.unlink if os.path.islink(target) else os.rmdir, target)
    if not keep_top:
        _quietly(os.rmdir, path)
