"""What the pool, its workers and their executors say to each other.

`WorkerConfig` is the one description of a worker (the pool fills it, the worker and its executor
read it; defaults live here only), `wall_limit` the one rule for a test's wall-clock net (local and
E2B), `ResultRow` the one shape a verdict travels in, and `send_message` / `recv_message` the
framing between a worker and its executor.

Standard library only, and no dataclasses (which import `inspect`): the executor imports this
module, and every module it holds makes each fork of it slower.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any

ISOLATION_LEVELS = ("required", "best_effort")
KILL_MARGIN = 2.0  # seconds an executor may take to kill and reap a job beyond its deadline


def wall_limit(cpu_limit: float, wall_factor: float) -> float:
    """The wall-clock safety net of a test with `cpu_limit` CPU seconds (re-armed while starved)."""
    return cpu_limit * wall_factor + 1.0


_DEFAULTS: dict[str, Any] = {
    # what a job gets unless it says otherwise
    "per_test_timeout": 6.0,
    "job_timeout": 60.0,
    "output_limit": 1 << 20,
    "wall_factor": 3.0,
    "overload_retries": 1,
    # per-child limits
    "memory_mb": 2048,
    "max_processes": 4,
    "max_threads": 32,
    "file_size_mb": 16,
    # the container (bwrap: path of the binary, None for no container)
    "bwrap": None,
    "seccomp": True,
    "task_limit": True,  # False where a container cannot enforce RLIMIT_NPROC (Linux < 5.14)
    "allow_network": False,
    "tmp_size_mb": 64,
    "sandbox_uid": None,
    "scratch_dir": "/tmp",
    "job_parent": None,  # set by the worker for its executor: where job directories go
    "grace": 1.0,  # seconds the executor waits past a child's own wall-clock net
}


class WorkerConfig:
    """Everything a sandbox worker and its executor need to know, with the defaults in one place."""

    __slots__ = tuple(_DEFAULTS)

    per_test_timeout: float
    job_timeout: float
    output_limit: int
    wall_factor: float
    overload_retries: int
    memory_mb: int
    max_processes: int
    max_threads: int
    file_size_mb: int
    bwrap: str | None
    seccomp: bool
    task_limit: bool
    allow_network: bool
    tmp_size_mb: int
    sandbox_uid: int | None
    scratch_dir: str
    job_parent: str | None
    grace: float

    def __init__(self, **values: Any) -> None:
        unknown = set(values) - set(_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown WorkerConfig fields: {sorted(unknown)}")
        for name, default in _DEFAULTS.items():
            setattr(self, name, values.get(name, default))

    @property
    def max_tasks(self) -> int:
        """RLIMIT_NPROC of a job: its processes and threads together."""
        return int(self.max_processes) + int(self.max_threads)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        values = json.loads(text)
        if type(values) is not dict:
            raise ValueError("a WorkerConfig is a JSON object")
        return cls(**values)

    def replace(self, **values: Any) -> WorkerConfig:
        return WorkerConfig(**{**self.to_dict(), **values})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"WorkerConfig({self.to_dict()!r})"


class ResultRow:
    """One test's verdict as the judge decides it, before it becomes a `base.TestResult`."""

    __slots__ = ("actual", "error", "index", "stderr", "time", "verdict")

    def __init__(
        self,
        index: int,
        verdict: str,
        error: str = "",
        actual: str = "",
        stderr: str = "",
        time: float = 0.0,
    ) -> None:
        self.index = index
        self.verdict = verdict
        self.error = error
        self.actual = actual
        self.stderr = stderr
        self.time = time

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResultRow:
        return cls(
            int(data["index"]),
            str(data["verdict"]),
            str(data.get("error", "")),
            str(data.get("actual", "")),
            str(data.get("stderr", "")),
            float(data.get("time", 0.0)),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ResultRow) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"ResultRow({self.to_dict()!r})"


# --- framed messages between a worker and its executor ------------------------------------------


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def send_message(fd: int, header: dict[str, Any], blob: bytes = b"") -> None:
    """Write one message: a JSON header and an opaque blob, each with its length up front."""
    head = json.dumps(header).encode()
    write_all(fd, struct.pack("!II", len(head), len(blob)) + head + blob)


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    parts, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                return None
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def recv_message(fd: int, deadline: float | None = None) -> tuple[dict[str, Any], bytes] | None:
    """One message, or None on EOF or when `deadline` (monotonic) passes first."""
    sizes = _read_exact(fd, 8, deadline)
    if sizes is None:
        return None
    head_size, blob_size = struct.unpack("!II", sizes)
    head = _read_exact(fd, head_size, deadline)
    blob = _read_exact(fd, blob_size, deadline) if blob_size else b""
    if head is None or blob is None:
        return None
    return json.loads(head), blob
