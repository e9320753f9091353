"""Linux process isolation for sandbox workers: namespaces, a read-only root, a dropped uid, rlimits.

Stdlib + ctypes only. Every step is best effort: what the OS refuses is reported back (and logged
by the pool) rather than failing the sandbox. This confines honest mistakes and sloppy code (hangs,
fork bombs, memory blow-ups, stray writes, network calls); it is not a security boundary against a
determined attacker.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_KEEPCAPS = 8
CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class IsolationReport:
    """What a worker managed to set up; `missing` lists what it could not.

    A plain class, not a dataclass: `dataclasses` imports `inspect`, and every module the worker
    holds makes each fork of it slower.
    """

    def __init__(self) -> None:
        self.network_isolated = False
        self.readonly_root = False
        self.sandbox_uid: int | None = None
        self.missing: list[str] = []


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC  # loaded once per process: a fresh CDLL per forked child costs half a millisecond
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def isolate_worker(
    scratch_root: str, network: bool, readonly_root: bool, report: IsolationReport
) -> None:
    """Move this (worker) process into new mount/net namespaces; children inherit them."""
    if os.geteuid() != 0:
        report.missing.append("namespaces (not root)")
        return
    libc = _libc()
    flags = (CLONE_NEWNET if not network else 0) | (CLONE_NEWNS if readonly_root else 0)
    if not flags:
        return
    try:
        _check(libc.unshare(flags), "unshare")
    except OSError as err:
        report.missing.append(f"namespaces ({err})")
        return
    report.network_isolated = not network
    if readonly_root:
        try:
            root, scratch = b"/", scratch_root.encode()
            _check(libc.mount(None, root, None, MS_REC | MS_PRIVATE, None), "make mounts private")
            _check(libc.mount(scratch, scratch, None, MS_BIND | MS_REC, None), "bind scratch")
            _check(
                libc.mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None), "remount / ro"
            )
            report.readonly_root = True
        except OSError as err:
            report.missing.append(f"read-only root ({err})")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class UidDropper:
    """Becomes `uid` in a forked child (so RLIMIT_NPROC applies), keeping only the right to read.

    Reading stays allowed because the interpreter and its libraries may live in a directory only
    root can read (for example a pyenv under /root), and user code imports lazily. The ctypes
    arguments are built once in the worker: building them in every child costs more than the call.
    """

    def __init__(self, uid: int) -> None:
        self.uid = uid
        libc = _libc()
        # Resolved here, not in the child: the first lookup of a ctypes symbol costs page faults.
        self._prctl = libc.prctl
        self._capset = libc.capset
        self._header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
        self._data = (_CapData * 2)()
        self._data[0].effective = self._data[0].permitted = 1 << CAP_DAC_READ_SEARCH
        self._header_ref = ctypes.byref(self._header)
        self._data_ref = ctypes.byref(self._data)

    def drop(self) -> None:
        _check(self._prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl keepcaps")
        os.setgroups([])
        os.setgid(self.uid)
        os.setuid(self.uid)
        _check(self._capset(self._header_ref, self._data_ref), "capset")


def count_tasks_of(uid: int) -> int:
    """How many tasks (threads included, as RLIMIT_NPROC counts them) `uid` runs now."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return count


def apply_limits(
    memory_bytes: int, cpu_seconds: int, max_processes: int, file_bytes: int, running_tasks: int
) -> None:
    """Set the rlimits of the calling (child) process.

    RLIMIT_NPROC counts every task of the uid: `running_tasks` is how many it already has (0 for a
    dedicated uid), so that the child may start `max_processes` more.
    """
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = running_tasks + max_processes
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing


class Reaper:
    """A helper process running as `uid` that kills every other process of that uid on request.

    ``kill(-1, SIGKILL)`` from a process of uid X reaches all of X's processes but the caller, so
    children that escaped their process group (setsid, double fork) die too. It lives across jobs
    because forking one per job costs more than the job; if user code kills it, it is restarted.
    """

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.pid = 0
        self._start()

    def _start(self) -> None:
        request_r, self._request_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(self._request_w)
                os.close(self._reply_r)
                os.setsid()
                os.setuid(self.uid)
                while os.read(request_r, 1):
                    try:
                        os.kill(-1, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    os.write(reply_w, b"k")
            finally:
                os._exit(0)
        os.close(request_r)
        os.close(reply_w)
        self.pid = pid

    def _stop(self) -> None:
        for fd in (self._request_w, self._reply_r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (OSError, ChildProcessError):
            pass

    def reap(self) -> None:
        """Kill every process of the uid; returns once done."""
        for _ in range(2):
            try:
                os.write(self._request_w, b"x")
                if os.read(self._reply_r, 1) == b"k":
                    return
            except OSError:
                pass
            self._stop()  # killed by the code it guards: start a new one and try again
            self._start()
        raise RuntimeError("sandbox reaper could not be restarted")

    def close(self) -> None:
        self._stop()
