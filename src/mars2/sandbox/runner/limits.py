"""Per-process limits of sandbox jobs: rlimits, the uid drop, and the few `prctl` flags we set.

Standard library and ctypes only; no namespaces, mounts or seccomp programs here (bubblewrap and
libseccomp set those up, see `mars2.sandbox.container`).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_prctl = None


def _call_prctl(option: int, value: int) -> None:
    global _prctl  # resolved once per process: a fresh CDLL per forked child costs faults
    if _prctl is None:
        function = ctypes.CDLL(None, use_errno=True).prctl
        function.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        function.restype = ctypes.c_int
        _prctl = function
    if _prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}): {os.strerror(errno)}")


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it exits."""
    _call_prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def set_no_new_privs() -> None:
    """No execve may ever grant this process (or its children) more privileges."""
    _call_prctl(_PR_SET_NO_NEW_PRIVS, 1)


def set_undumpable() -> None:
    """Processes of the same uid without CAP_SYS_PTRACE may no longer ptrace this one or read
    and write its memory through /proc; its children inherit the flag."""
    _call_prctl(_PR_SET_DUMPABLE, 0)


def drop_to(uid: int) -> None:
    """Leave root for `uid` (and its own gid): every capability goes with it."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # from root to another uid, without KEEPCAPS: every capability goes


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


def kill_uid(uid: int, deadline: float) -> bool:
    """As root, SIGKILL every process of `uid` until none is left or `deadline` passes.

    The reaper where the executor is not init of a pid namespace (no container): it runs in the
    (root) executor, so no job can signal or stop it. Returns whether the uid was left with no
    process.
    """
    me = os.getpid()
    while True:
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found = True
                    os.kill(int(name), signal.SIGKILL)
            except OSError:
                continue
        if not found:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def apply_limits(memory_bytes: int, cpu_seconds: int, max_tasks: int | None) -> None:
    """Set the per-job rlimits of the calling (child) process.

    RLIMIT_NPROC counts every task (process or thread) of the uid: `max_tasks` is the limit to set
    here (including what a shared uid already runs), or None where the executor set it once.
    """
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    if max_tasks is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (max_tasks, max_tasks))


def apply_inherited_limits(file_bytes: int, max_tasks: int | None) -> None:
    """What every job shares, set once on the process that forks them (inherited by fork): no
    core dumps, the file-size cap (an oversized write fails instead of killing the job with
    SIGXFSZ) and, where given, the task limit."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if max_tasks is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (max_tasks, max_tasks))
