"""The seccomp filter of sandbox jobs, built and loaded by libseccomp.

Every job inherits it from the executor: bubblewrap loads it (exported as BPF by libseccomp,
`--add-seccomp-fd`) on the executor of a container before the executor's first instruction, and
an executor without a container loads it on itself (with no_new_privs, which libseccomp sets)
before it forks any answer. It refuses, with EPERM: new namespaces (`unshare`,
`setns`, and `clone` with any CLONE_NEW* flag), mounting (`mount`, `umount2`, `pivot_root`,
`chroot` and the new mount API), `bpf`, `userfaultfd`, `perf_event_open`, the keyring calls, and
the IPC objects that outlive a job (System V IPC, POSIX message queues). `clone3` answers ENOSYS,
so that libc falls back to `clone`, whose flags a filter can read (clone3 keeps them in memory).

The rules are added by name for this machine's architecture and every other one libseccomp knows
that a filter may hold beside it (those of the same byte order and the same `clone` argument
layout: 32-bit x86 and x32 beside x86_64, arm beside aarch64, ...), so a job cannot step around
them through another system call ABI. A call newer than this libseccomp's tables (Debian 12's
2.5.4 does not know `open_tree_attr`) is refused by its number on the native architecture in a
second filter.

The binding: libseccomp's own (`seccomp`, Debian's python3-seccomp) where the interpreter has it,
else pyseccomp (`pip install pyseccomp`, a ctypes binding with the same API and a declared
dependency of mars2). Both drive the system's libseccomp (Debian: libseccomp2).
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from types import ModuleType
from typing import Any

# What jobs may not call (refused with EPERM on every architecture in the filter).
REFUSED = (
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot",
    "bpf", "userfaultfd", "perf_event_open", "keyctl", "add_key", "request_key",
    "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "open_tree_attr",
)  # fmt: skip
# Calls that exist only on some architectures: not an error where none in the filter has them.
_OPTIONAL = {"umount"}
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: `clone` with any is refused.
NAMESPACE_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
# Numbers of calls newer than some libseccomp releases, from the kernel's unified table (the same
# on every architecture that has no offset of its own).
_UNIFIED_NUMBERS = {"open_tree_attr": 467}
_UNIFIED_ARCHES = ("X86_64", "X86", "AARCH64", "ARM", "RISCV64", "PPC64LE", "PPC64", "S390X")
# Architectures whose clone takes the flags second (clone(stack, flags, ...)).
_CLONE_FLAGS_SECOND = ("S390", "S390X")
_BINDINGS = ("seccomp", "pyseccomp")


class SeccompUnavailable(RuntimeError):
    """libseccomp, its Python binding or the kernel's seccomp filters are missing here."""


def binding() -> ModuleType:
    """libseccomp's Python binding: Debian's `seccomp` if present, else `pyseccomp`."""
    reasons = []
    for name in _BINDINGS:
        try:
            module = importlib.import_module(name)
        except (ImportError, OSError, RuntimeError) as err:  # pyseccomp raises without the .so
            reasons.append(f"{name}: {err}")
            continue
        if hasattr(module, "SyscallFilter") and hasattr(module, "Arch"):
            return module
        reasons.append(f"{name}: not libseccomp's binding")
    raise SeccompUnavailable(
        "libseccomp's Python binding is not importable by "
        f"{sys.executable} ({'; '.join(reasons)}): pip install pyseccomp "
        "(needs the system's libseccomp2), or on Debian/Ubuntu apt install python3-seccomp"
    )


def kernel_supports_filters() -> bool:
    """Whether this kernel was built with seccomp filters (CONFIG_SECCOMP_FILTER)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            return any(line.startswith("Seccomp_filters:") for line in handle)
    except OSError:
        return False


def _arches(lib: ModuleType) -> list[tuple[str, int]]:
    return [
        (name, int(getattr(lib.Arch, name)))
        for name in sorted(vars(lib.Arch))
        if name.isupper() and name != "NATIVE" and isinstance(getattr(lib.Arch, name), int)
    ]


def _native_name(lib: ModuleType) -> str | None:
    native = int(lib.system_arch()) & 0xFFFFFFFF
    for name, token in _arches(lib):
        if token & 0xFFFFFFFF == native:
            return name
    return None


def build_filters(lib: ModuleType | None = None) -> tuple[list[Any], list[str]]:
    """The filters to load, in order, and the refused calls that none of them covers.

    The first filter holds every rule, for this architecture and each other one libseccomp can put
    in the same filter; the second (where needed) refuses by number, on this architecture only,
    the calls this libseccomp does not know by name.
    """
    lib = lib or binding()
    native = _native_name(lib)
    if native is None:
        raise SeccompUnavailable(
            f"libseccomp does not name this architecture ({os.uname().machine})"
        )
    flags_arg = 1 if native in _CLONE_FLAGS_SECOND else 0
    main = lib.SyscallFilter(lib.ALLOW)
    for name, token in _arches(lib):
        if name == native or (name in _CLONE_FLAGS_SECOND) != (native in _CLONE_FLAGS_SECOND):
            continue
        try:
            main.add_arch(token)
        except (OSError, RuntimeError, ValueError):
            continue  # another byte order: a filter holds one
    unknown = []
    for call in REFUSED:
        try:
            main.add_rule(lib.ERRNO(errno.EPERM), call)
        except (OSError, RuntimeError, ValueError):
            if call not in _OPTIONAL:
                unknown.append(call)
    main.add_rule(lib.ERRNO(errno.ENOSYS), "clone3")
    for flag in NAMESPACE_FLAGS:
        main.add_rule(
            lib.ERRNO(errno.EPERM), "clone", lib.Arg(flags_arg, lib.MASKED_EQ, flag, flag)
        )
    filters = [main]
    by_number = [c for c in unknown if c in _UNIFIED_NUMBERS and native in _UNIFIED_ARCHES]
    if by_number:
        extra = lib.SyscallFilter(lib.ALLOW)
        extra.set_attr(lib.Attr.ACT_BADARCH, lib.ALLOW)  # the first filter judges the other ABIs
        for call in by_number:
            extra.add_rule(lib.ERRNO(errno.EPERM), _UNIFIED_NUMBERS[call])
        filters.append(extra)
    return filters, [c for c in unknown if c not in by_number]


def install() -> list[str]:
    """Load the filters on the calling process (and so on every process it forks from now on).

    Returns the refused calls no filter covers. Raises `SeccompUnavailable` where it cannot.
    """
    if not kernel_supports_filters():
        raise SeccompUnavailable("this kernel has no seccomp filters (CONFIG_SECCOMP_FILTER)")
    filters, uncovered = build_filters()
    try:
        for item in filters:
            item.load()
    except (OSError, RuntimeError) as err:
        raise SeccompUnavailable(f"loading the filter failed: {err}") from err
    return uncovered


def export_programs(lib: ModuleType | None = None) -> tuple[list[bytes], list[str]]:
    """The filters as BPF programs (what bubblewrap's --add-seccomp-fd loads), and the refused
    calls none of them covers."""
    import tempfile  # here: the executor, which may import this module, never needs it

    filters, uncovered = build_filters(lib)
    programs = []
    for item in filters:
        with tempfile.TemporaryFile() as handle:
            item.export_bpf(handle)
            handle.seek(0)
            programs.append(handle.read())
    return programs, uncovered


def installed_filters() -> int:
    """How many seccomp filters the calling process runs under (0 where none, or unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Seccomp_filters:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def export_text(lib: ModuleType | None = None) -> str:
    """The filters as libseccomp's pseudo-code (PFC), for reading and for tests."""
    import tempfile  # here: the executor, which imports this module, never needs it

    filters, _ = build_filters(lib)
    parts = []
    for item in filters:
        with tempfile.TemporaryFile("w+") as handle:
            item.export_pfc(handle)
            handle.seek(0)
            parts.append(handle.read())
    return "\n".join(parts)
