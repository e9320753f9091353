"""Ranks that share tensor-parallel vLLM engines (`generation.vllm.tensor_parallel_size: k`).

Under vLLM's ``external_launcher`` each of k consecutive trainer ranks is one tensor-parallel
worker of every shared engine (as in verl's hybrid engine), so each engine call must be made by
all k ranks at once with the same requests. The group's first rank, its leader, decides what to
generate; the others replay its calls:

- `call(key, payload)`: every rank of the group calls it in the same order (held-out evaluation);
  the leader's payload is broadcast and each rank runs `key`'s handler on it, so a follower's own
  arguments never reach an engine.
- `serve()` / `release()`: during a rollout only the leader searches; the followers replay its
  calls until it releases them, then `scatter` hands each rank its share of the samples.

Calls are serialised by a lock: two engines must not interleave their collectives (the pipelined
search generates for several agents from several threads), and followers replay in the leader's
order. Messages go over a gloo group of the k ranks (prompts are lists of token ids).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

RELEASE = None


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class EngineGroup:
    """This rank's group of `size` ranks sharing tensor-parallel engines (see module docstring)."""

    def __init__(self, size: int) -> None:
        dist = _dist()
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        if size < 1 or world % size:
            raise ValueError(
                f"generation.vllm.tensor_parallel_size={size} must divide the number of trainer "
                f"ranks ({world}): each rank is one tensor-parallel worker of the engines"
            )
        rank = dist.get_rank() if initialized else 0
        self.size, self.index, self.count = size, rank // size, world // size
        self.rank = rank
        self.leader = self.index * size  # global rank of the group's leader
        self.is_leader = rank == self.leader
        self._group: Any = None
        if size > 1:  # every rank creates every group, in the same order, as torch requires
            for g in range(self.count):
                group = dist.new_group(list(range(g * size, (g + 1) * size)), backend="gloo")
                if g == self.index:
                    self._group = group
        self._lock = threading.RLock()
        self._handlers: dict[str, Callable[[Any], Any]] = {}

    def register(self, key: str, handler: Callable[[Any], Any]) -> None:
        """`handler(payload)` runs `key`'s engine call on this rank (a generator's generate)."""
        self._handlers[key] = handler

    def _exchange(self, message: Any) -> Any:
        if self.size == 1:
            return message
        box = [message if self.is_leader else None]
        _dist().broadcast_object_list(box, src=self.leader, group=self._group)
        return box[0]

    def call(self, key: str, payload: Any) -> Any:
        """`key`'s handler on the leader's payload, on every rank of the group."""
        with self._lock:
            message = self._exchange((key, payload))
            if message is RELEASE or message[0] != key:
                got = "a release" if message is RELEASE else f"engine {message[0]!r}"
                raise RuntimeError(
                    f"rank {self.rank} of engine group {self.index} called engine {key!r} while "
                    f"its leader (rank {self.leader}) sent {got}: the ranks of a "
                    "tensor-parallel group must make the same engine calls in the same order"
                )
            return self._handlers[key](message[1])

    def serve(self) -> int:
        """A follower replays the leader's calls until it releases the group; returns how many."""
        if self.is_leader:
            raise RuntimeError("the leader of an engine group makes the calls; it does not serve")
        served = 0
        while True:
            with self._lock:
                message = self._exchange(None)
                if message is RELEASE:
                    return served
                key, payload = message
                self._handlers[key](payload)
            served += 1

    def release(self) -> None:
        """The leader ends the followers' `serve`."""
        if not self.is_leader:
            raise RuntimeError("only the leader of an engine group releases it")
        with self._lock:
            self._exchange(RELEASE)

    def scatter(self, parts: list[Any] | None) -> Any:
        """The leader hands `parts[i]` to the group's i-th rank; every rank gets its own part."""
        if self.size == 1:
            assert parts is not None
            return parts[0]
        if self.is_leader and (parts is None or len(parts) != self.size):
            raise ValueError(f"the leader must scatter {self.size} parts")
        out: list[Any] = [None]
        _dist().scatter_object_list(
            out, parts if self.is_leader else None, src=self.leader, group=self._group
        )
        return out[0]


def engine_group_of(generators: Any) -> EngineGroup | None:
    """The engine group the generators' backends share (None when no engine is tensor parallel)."""
    for generator in dict(generators).values():
        group = getattr(getattr(generator, "backend", generator), "group", None)
        if isinstance(group, EngineGroup) and group.size > 1:
            return group
    return None
