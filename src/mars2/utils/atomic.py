"""Atomic file writes: a temporary file in the same folder, fsync, then rename over the target.

A reader (or a resumed run) sees either the old file or the complete new one, never a truncated
one; a failed write leaves the old file untouched and says how much space it needed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class WriteError(OSError):
    """A write that failed; the message names the path, the space it needed and what was free."""


def _free_bytes(path: Path) -> int | None:
    for folder in (path.parent, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def write_error(path: str | Path, needed: int | None, error: OSError) -> WriteError:
    """A `WriteError` for `path` that says what went wrong, how much was needed and what is free."""
    path = Path(path)
    free = _free_bytes(path)
    parts = [f"could not write {path}: {error.strerror or error}."]
    if needed is not None:
        parts.append(f"It needs {_mb(needed)}")
        parts.append(f"and {_mb(free)} are free there." if free is not None else "of space.")
    if error.errno == errno.ENOSPC:
        parts.append("The disk is full: free space or point the run elsewhere (hydra.run.dir=...).")
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        parts.append("The folder is not writable: pick another one (hydra.run.dir=...).")
    parts.append("Any previous version of the file is unchanged.")
    return WriteError(error.errno or 0, " ".join(parts))


def fsync_dir(folder: str | Path) -> None:
    """Make a rename in `folder` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def replace_from(tmp: str | Path, path: str | Path) -> None:
    """fsync the finished temporary file `tmp` and rename it over `path`."""
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """`open` for writing, but the target only changes when the block finishes without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        with open(tmp, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            raise write_error(path, None, error) from error
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` atomically; on failure the old file stays and the error says
    how many bytes were needed."""
    try:
        with atomic_open(path, "wb") as handle:
            handle.write(data)
    except WriteError as error:
        cause = error.__cause__ if isinstance(error.__cause__, OSError) else error
        raise write_error(path, len(data), cause) from cause


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))
