"""The multi-rank tests' harness: a function run on two gloo CPU processes."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any


def _entry(rank: int, port: int, main: Callable[..., None], args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        main(rank, *args)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def on_two_gloo_ranks(main: Callable[..., None], *args: Any) -> None:
    """`main(rank, *args)` on ranks 0 and 1 of a gloo process group (a module-level function)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(free_port(), main, args), nprocs=2, join=True)
