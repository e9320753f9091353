"""Machine-wide leases on sandbox uids, so that two pools never share (and never reap) a uid.

Each uid a pool uses is held through an exclusive `flock` on a file named after it. The kernel
drops the lock when the holder closes it or dies, so a crashed run frees its uids by itself and a
stale lock file is never a problem.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

DEFAULT_FIRST_UID = 61000
DEFAULT_UID_SPAN = 4000


def default_lock_dir() -> Path:
    """Where the lease files live: /run/lock when writable, else the temp directory."""
    for candidate in (Path("/run/lock"), Path(tempfile.gettempdir())):
        if candidate.is_dir() and os.access(candidate, os.W_OK):
            return candidate / "mars2-sandbox-uids"
    return Path(tempfile.gettempdir()) / "mars2-sandbox-uids"


class UidLease:
    """Holds `count` uids no other live lease on this machine holds, until `release`."""

    def __init__(
        self,
        count: int,
        first_uid: int = DEFAULT_FIRST_UID,
        span: int = DEFAULT_UID_SPAN,
        lock_dir: Path | None = None,
    ) -> None:
        if count < 0:
            raise ValueError("count must be >= 0")
        self.lock_dir = lock_dir or default_lock_dir()
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        self._fds: dict[int, int] = {}
        try:
            for uid in range(first_uid, first_uid + span):
                if len(self._fds) == count:
                    break
                fd = self._try_lock(uid)
                if fd is not None:
                    self._fds[uid] = fd
            if len(self._fds) < count:
                raise RuntimeError(
                    f"only {len(self._fds)} of {count} sandbox uids are free in "
                    f"[{first_uid}, {first_uid + span}) (locks in {self.lock_dir}): "
                    "too many sandbox pools are running on this machine"
                )
        except BaseException:
            self.release()
            raise

    def _try_lock(self, uid: int) -> int | None:
        fd = os.open(self.lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @property
    def uids(self) -> list[int]:
        """The leased uids, lowest first."""
        return sorted(self._fds)

    def release(self) -> None:
        """Give every uid back (idempotent)."""
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
