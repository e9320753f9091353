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
from dataclasses import dataclass, field

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


@dataclass
class IsolationReport:
    """What a worker managed to set up; `missing` lists what it could not."""

    network_isolated: bool = False
    readonly_root: bool = False
    sandbox_uid: int | None = None
    missing: list[str] = field(default_factory=list)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def isolate_worker(scratch_root: str, network: bool, readonly_root: bool, report: IsolationReport) -> None:
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
            _check(libc.mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None), "remount / ro")
            report.readonly_root = True
        except OSError as err:
            report.missing.append(f"read-only root ({err})")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_to_uid(uid: int) -> None:
    """Become `uid` (so RLIMIT_NPROC applies), keeping only the right to read files.

    Reading stays allowed because the interpreter and its libraries may live in a directory only
    root can read (for example a pyenv under /root), and user code imports lazily.
    """
    libc = _libc()
    _check(libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl keepcaps")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = 1 << CAP_DAC_READ_SEARCH
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def _count_tasks_of(uid: int) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
    return count


def apply_limits(memory_bytes: int, cpu_seconds: int, max_processes: int, file_bytes: int, dedicated_uid: bool) -> None:
    """Set the rlimits of the calling (child) process."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # RLIMIT_NPROC counts every task of the uid; with a shared uid, leave room for those running.
    base = 0 if dedicated_uid else _count_tasks_of(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (base + max_processes, base + max_processes))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing


def kill_all_of_uid(uid: int) -> None:
    """Kill every process running as `uid` (escaped grandchildren included), from a short-lived fork."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
