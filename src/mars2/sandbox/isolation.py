"""Linux process isolation for sandbox workers: namespaces, private mounts, a dropped uid, seccomp.

Stdlib + ctypes only. Every step is best effort: what the OS refuses is reported back (and logged
by the pool) rather than failing the sandbox. See README's security paragraph for what this does
and does not guarantee.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
import struct
import sys
import time
from collections.abc import Iterable

from mars2.sandbox.scratch import make_private_dir

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
# CLONE_NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWNS
_NAMESPACE_FLAGS = 0x7E020000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
# The new mount API (Linux 5.2+): its calls have the same numbers on every architecture.
_MOUNT_API = dict(
    open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
    mount_setattr=442, open_tree_attr=467,
)  # fmt: skip


class IsolationReport:
    """What a worker managed to set up; `missing` lists what it could not.

    A plain class, not a dataclass: `dataclasses` imports `inspect`, and every module the worker
    holds makes each fork of it slower.
    """

    def __init__(self) -> None:
        self.network_isolated = False
        self.readonly_root = False
        self.pid_namespace = False
        self.private_tmp = False
        self.ipc_isolated = False
        self.seccomp = False
        self.sandbox_uid: int | None = None
        self.hidden: list[str] = []
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


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _check(_libc().mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


def interpreter_paths() -> list[str]:
    """Directories user code may import from: the interpreter's prefixes and its sys.path."""
    found: list[str] = []
    here = os.getcwd()  # sys.path[0] under `python -m`: the trainer's directory, not the library's
    for path in [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]:
        if path and path != here and os.path.isdir(path):
            real = os.path.realpath(path)
            if real not in found:
                found.append(real)
    # Keep only the outermost: binding a prefix brings what is below it.
    return [p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found)]


def _closed_ancestor(path: str) -> str | None:
    """The outermost directory above `path` that other users may not enter, if any."""
    parts = path.strip(os.sep).split(os.sep)
    for depth in range(len(parts)):
        ancestor = os.sep + os.sep.join(parts[:depth])
        if ancestor != path and not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _hide_all_but(top: str, keep: list[str], options: str) -> None:
    """Cover `top` with an empty tmpfs and bring back only the directories in `keep`.

    The kept directories are held by descriptors, so nothing is staged on the host's filesystem:
    a worker killed at any point leaves nothing behind.
    """
    kept = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in keep]
    try:
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for path, fd in kept:
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
    finally:
        for _, fd in kept:
            os.close(fd)


def _expose_interpreter(needed: Iterable[str], report: IsolationReport) -> list[str]:
    """Make what Python imports readable without CAP_DAC_READ_SEARCH.

    For a directory others cannot enter (e.g. /root, holding a pyenv), this worker's mount
    namespace gets an empty tmpfs over it with only the needed paths bound back: everything else
    in it disappears for the jobs (and for this worker). Returns the paths bound back.
    """
    closed: dict[str, list[str]] = {}
    for path in needed:
        ancestor = _closed_ancestor(path)
        if ancestor is not None:
            closed.setdefault(ancestor, []).append(path)
    bound: list[str] = []
    for ancestor, paths in sorted(closed.items()):
        _hide_all_but(ancestor, paths, "size=1m,mode=0755")
        report.hidden.append(ancestor)
        bound += paths
    return bound


def _host_scratch(scratch_dir: str) -> str:
    root = make_private_dir(scratch_dir, "mars2-sandbox-")
    os.chmod(root, 0o711)  # job uids pass through to their own directories
    return root


def isolate_worker(
    scratch_dir: str,
    network: bool,
    readonly_root: bool,
    tmp_size_mb: int,
    report: IsolationReport,
    pid_namespace: bool = True,
) -> tuple[str, str | None]:
    """Move this (worker) process into new mount/net/pid/IPC namespaces; children inherit them.

    Returns where job directories go and what the pool must remove once this worker is gone:
    ("/tmp", None) on a private, size-capped tmpfs, which leaves nothing on the host whatever
    happens to the worker; otherwise a fresh directory under `scratch_dir`, twice.
    """
    if os.geteuid() != 0:
        report.missing.append("namespaces (not root)")
        root = _host_scratch(scratch_dir)
        return root, root
    libc = _libc()
    flags = (CLONE_NEWNET if not network else 0) | CLONE_NEWNS
    try:
        _check(libc.unshare(flags), "unshare")
    except OSError as err:
        report.missing.append(f"namespaces ({err})")
        root = _host_scratch(scratch_dir)
        return root, root
    report.network_isolated = not network
    try:
        # The next child forked (the executor) is init of a pid namespace holding only jobs.
        if not pid_namespace:
            raise OSError(0, "disabled by the configuration")
        _check(libc.unshare(CLONE_NEWPID), "unshare pid")
        report.pid_namespace = True
    except OSError as err:
        report.missing.append(f"pid namespace ({err}): jobs are reaped by uid")
    try:
        _check(libc.unshare(CLONE_NEWIPC), "unshare ipc")
        _forbid_ipc_objects()
        report.ipc_isolated = True
    except OSError as err:
        report.missing.append(f"IPC namespace ({err}): only seccomp keeps jobs off System V IPC")
    job_root: str | None = None
    host_dir: str | None = None
    private = False
    bound: list[str] = []  # mounts of their own: the read-only root does not cover them
    needed = interpreter_paths()
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        private = True  # from here on, no mount of ours propagates to the host
        bound += _expose_interpreter(needed, report)
        if any(p == "/dev/shm" or p.startswith("/dev/shm" + os.sep) for p in needed):
            raise OSError(0, "the interpreter lives under /dev/shm: no private tmpfs")
        # An interpreter (or a checkout) under /tmp is bound back onto the private tmpfs.
        under_tmp = [p for p in needed if p == "/tmp" or p.startswith("/tmp" + os.sep)]
        if "/tmp" in under_tmp:
            raise OSError(0, "the interpreter's path is /tmp itself: no private tmpfs")
        options = f"size={max(1, tmp_size_mb)}m"
        _hide_all_but("/tmp", under_tmp, options + ",mode=0755")
        bound += under_tmp
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, options + ",mode=1777")
        job_root = "/tmp"
        report.private_tmp = True
    except OSError as err:
        report.missing.append(f"private mounts ({err})")
    if job_root is None:
        job_root = host_dir = _host_scratch(scratch_dir)
        try:
            if not private:
                raise OSError(0, "mounts here would reach the host")
            # Its own mount, so that it stays writable under the read-only root below.
            _mount(job_root, job_root, None, MS_BIND | MS_REC, None)
        except OSError as err:
            if readonly_root:
                report.missing.append(f"read-only root (jobs' directory not separable: {err})")
            readonly_root = False
    if readonly_root:
        try:
            _make_read_only(bound, job_root)
            report.readonly_root = True
        except OSError as err:
            report.missing.append(f"read-only root ({err})")
    return job_root, host_dir


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clear", "propagation", "userns_fd")]


_MOUNT_SETATTR = _MOUNT_API["mount_setattr"]
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1


def _mount_setattr(path: str, recursive: bool, read_only: bool) -> None:
    attr = _MountAttr(
        _MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else _MOUNT_ATTR_RDONLY
    )
    flags = _AT_RECURSIVE if recursive else 0
    # As longs: syscall(2) reads every argument as one, and -100 must arrive sign-extended.
    number, dirfd, size = (
        ctypes.c_long(v) for v in (_MOUNT_SETATTR, _AT_FDCWD, ctypes.sizeof(attr))
    )
    result = _libc().syscall(
        number, dirfd, path.encode(), ctypes.c_long(flags), ctypes.byref(attr), size
    )
    _check(result, f"mount_setattr {path}")


def _make_read_only(bound: list[str], job_root: str) -> None:
    """Every mount in this namespace read-only but the jobs' directory (a mount) and /dev/shm.

    Other filesystems mounted on the host (a /home or /var/tmp of their own, say) are mounts
    the root's remount does not reach: mount_setattr (Linux 5.12) covers them all at once.
    Older kernels get the root and the interpreter's directories bound back, one by one.
    """
    try:
        _mount_setattr("/", recursive=True, read_only=True)
    except OSError:
        _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        for path in bound:
            _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
        return
    _mount_setattr(job_root, recursive=False, read_only=False)
    try:
        _mount_setattr("/dev/shm", recursive=False, read_only=False)
    except OSError:
        pass  # not a mount of its own (EINVAL): it stays part of the read-only /dev


# System V IPC objects and POSIX message queues outlive the process that made them: a job could
# leave memory behind (outside every limit) or pass data to a later job. Their limits are
# per IPC namespace, so in the worker's own namespace they are set to zero.
_IPC_LIMITS = {
    "/proc/sys/kernel/shmmni": "0",
    "/proc/sys/kernel/msgmni": "0",
    "/proc/sys/kernel/sem": "0 0 0 0",
    "/proc/sys/fs/mqueue/queues_max": "0",
}


def _forbid_ipc_objects() -> None:
    for path, value in _IPC_LIMITS.items():
        with open(path, "w", encoding="ascii") as handle:
            handle.write(value)


# --- seccomp -----------------------------------------------------------------------------------

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# unshare, setns, clone, clone3, mount, umount2, pivot_root, chroot, bpf, userfaultfd,
# perf_event_open, the keyring calls, System V IPC, POSIX message queues and the new mount API
_SYSCALLS = {
    "x86_64": dict(
        unshare=272, setns=308, clone=56, clone3=435, mount=165, umount2=166, pivot_root=155,
        chroot=161, bpf=321, userfaultfd=323, perf_event_open=298, keyctl=250, add_key=248,
        request_key=249, shmget=29, shmat=30, shmctl=31, shmdt=67, semget=64, semop=65, semctl=66,
        semtimedop=220, msgget=68, msgsnd=69, msgrcv=70, msgctl=71, mq_open=240, mq_unlink=241,
        mq_timedsend=242, mq_timedreceive=243, mq_notify=244, mq_getsetattr=245, **_MOUNT_API,
    ),
    "aarch64": dict(
        unshare=97, setns=268, clone=220, clone3=435, mount=40, umount2=39, pivot_root=41,
        chroot=51, bpf=280, userfaultfd=282, perf_event_open=241, keyctl=219, add_key=217,
        request_key=218, shmget=194, shmat=196, shmctl=195, shmdt=197, semget=190, semop=193,
        semctl=191, semtimedop=192, msgget=186, msgsnd=189, msgrcv=188, msgctl=187, mq_open=180,
        mq_unlink=181, mq_timedsend=182, mq_timedreceive=183, mq_notify=184, mq_getsetattr=185,
        **_MOUNT_API,
    ),
}  # fmt: skip
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def seccomp_program() -> bytes | None:
    """A BPF filter refusing new namespaces (unshare, setns, clone with CLONE_NEW*), a few kernel
    attack surfaces (the new mount API among them) and the IPC objects that outlive a job
    (System V IPC, POSIX message queues);
    clone3 answers ENOSYS so that libc falls back to clone, whose flags the filter can read.
    None on architectures it does not know."""
    machine = platform.machine()
    if machine not in _AUDIT_ARCH:
        return None
    nr = _SYSCALLS[machine]
    code: list[
        tuple[int, int, int, int]
    ] = []  # (op, jt, jf, k) with jt/jf as labels resolved below
    deny, nosys, allow = "deny", "nosys", "allow"
    prog: list[tuple[int, object, object, int]] = [
        (0x20, 0, 0, 4),  # ld arch
        (0x15, 0, deny, _AUDIT_ARCH[machine]),  # jeq arch
        (0x20, 0, 0, 0),  # ld nr
        (0x35, deny, 0, 0x40000000),  # jge x32 syscall bit
        (0x15, nosys, 0, nr["clone3"]),
    ]
    for name in nr:
        if name not in ("clone", "clone3"):
            prog.append((0x15, deny, 0, nr[name]))
    prog += [
        (0x15, 0, allow, nr["clone"]),
        (0x20, 0, 0, 16),  # ld args[0] (low 32 bits)
        (0x45, deny, 0, _NAMESPACE_FLAGS),  # jset
    ]
    labels = {allow: len(prog), deny: len(prog) + 1, nosys: len(prog) + 2}
    prog += [
        (0x06, 0, 0, _RET_ALLOW),
        (0x06, 0, 0, _RET_ERRNO | _EPERM),
        (0x06, 0, 0, _RET_ERRNO | _ENOSYS),
    ]
    for position, (op, jt, jf, k) in enumerate(prog):
        jumps = [labels[j] - position - 1 if isinstance(j, str) else j for j in (jt, jf)]
        code.append((op, int(jumps[0]), int(jumps[1]), k))  # type: ignore[call-overload]
    return b"".join(struct.pack("HBBI", op, jt, jf, k) for op, jt, jf, k in code)


class UidDropper:
    """Becomes `uid` in a forked child with no capabilities, no_new_privs and the seccomp filter.

    The ctypes arguments are built once in the worker: building them in every child costs more
    than the calls.
    """

    def __init__(self, uid: int | None, report: IsolationReport) -> None:
        self.uid = uid
        libc = _libc()
        # Resolved here, not in the child: the first lookup of a ctypes symbol costs page faults.
        self._prctl = libc.prctl
        self._prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        self._prctl.restype = ctypes.c_int
        program = seccomp_program()
        self._filter_bytes = program
        self._fprog = None
        if program is None:
            report.missing.append(f"seccomp filter (unknown architecture {platform.machine()})")
        else:
            self._buffer = ctypes.create_string_buffer(program, len(program))
            self._fprog = _SockFprog(len(program) // 8, ctypes.cast(self._buffer, ctypes.c_char_p))
            self._fprog_ref = ctypes.addressof(self._fprog)
        self.seccomp_ok = self._fprog is not None

    def drop(self) -> None:
        """In the child: leave root for the sandbox uid (every capability goes with it)."""
        if self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)  # from root to another uid, without KEEPCAPS: every capability goes

    def lock_down(self) -> None:
        """Set no_new_privs and install the seccomp filter on the calling process; both are
        inherited by every process it forks afterwards and can never be removed."""
        _check(self._prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        if self._fprog is not None:
            _check(
                self._prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, self._fprog_ref, 0, 0), "seccomp"
            )


def probe_seccomp(dropper: UidDropper) -> str | None:
    """Install the filter in a throwaway child; the reason it fails, or None when it works."""
    if dropper._fprog is None:
        return "no filter for this architecture"
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _check(dropper._prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
            _check(
                dropper._prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, dropper._fprog_ref, 0, 0),
                "seccomp",
            )
        except OSError:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return None if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else "prctl refused it"


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

    The fallback reaper where no pid namespace could be made: it runs in the (root) executor, so
    no job can signal or stop it. Returns whether the uid was left with no process.
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
    SIGXFSZ) and, where given, the task limit (it binds a job once it leaves root)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if max_tasks is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (max_tasks, max_tasks))
