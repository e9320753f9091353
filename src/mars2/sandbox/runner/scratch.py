"""Scratch directories for sandbox jobs, made and removed without `tempfile` or `shutil`.

The sandbox worker imports this instead of those modules: with what they pull in (bz2, lzma,
random, ...) they would make every fork of the worker slower.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator


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


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str, keep_top: bool = False) -> None:
    """Delete what can be deleted under `path` (and `path` unless `keep_top`); never follows links.

    A job's tree can be deeper than the recursion limit and longer than PATH_MAX, so this walks
    it by directory descriptors, one open at a time, with its own stack of unread entries.
    """
    try:
        fd = os.open(path, _DIRECTORY)
    except OSError:
        return
    # For each directory above the current one: its name, and its entries not yet visited.
    above: list[tuple[str, Iterator[str]]] = []
    entries = _entries(fd)
    try:
        while True:
            inner = None
            for name in entries:
                try:
                    os.unlink(name, dir_fd=fd)  # a file or a link; a directory refuses
                    continue
                except IsADirectoryError:
                    pass
                except OSError:
                    continue
                try:
                    inner = os.open(name, _DIRECTORY, dir_fd=fd)
                except OSError:
                    continue
                above.append((name, entries))
                break
            if inner is not None:
                os.close(fd)
                fd, entries = inner, _entries(inner)
                continue
            if not above:
                break
            parent = os.open("..", _DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            name, entries = above.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                pass  # not empty: something in it could not be removed
    except OSError:
        pass  # lost the way back up: what is left stays
    finally:
        os.close(fd)
    if not keep_top:
        _quietly(os.rmdir, path)


def _entries(fd: int) -> Iterator[str]:
    try:
        return iter(os.listdir(fd))
    except OSError:
        return iter(())
