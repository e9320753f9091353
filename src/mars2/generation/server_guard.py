"""``python -m mars2.generation.server_guard <trainer pid> -- <command...>``: run a server so that
nothing of it outlives the trainer.

The guard leads its own process group (the launcher starts it with ``start_new_session``), starts
the server in that group and watches: when the trainer is gone (``kill -9``, a crash, Ctrl-C
without cleanup), when the guard is signalled, or when the server exits, it sends SIGTERM to the
whole group (the server and every process it started, e.g. vLLM's engine core), then SIGKILL
after a grace period. Imports nothing heavy: it must start in well under a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 15.0


def _end_group(code: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches the guard too
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:  # any other member of the group left? (the guard itself does not count)
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.1)
    for pid in group_members(os.getpid()):  # what ignored SIGTERM (the guard stays, for `code`)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(code)


def group_members(group: int) -> list[int]:
    """The live processes of process group `group` other than this one (from /proc; zombies,
    which hold nothing and wait for a reaper, do not count)."""
    me, members = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # pgrp, state
            members.append(int(entry))
    return members


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m mars2.generation.server_guard <pid> -- <command...>")
    trainer = int(argv[0])
    server = subprocess.Popen(argv[2:])
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    while not stop["now"]:
        if server.poll() is not None:
            _end_group(server.returncode if server.returncode >= 0 else 128 - server.returncode)
        if os.getppid() != trainer:  # re-parented: the trainer is gone
            break
        time.sleep(0.5)
    _end_group(0)


if __name__ == "__main__":
    main(sys.argv[1:])
