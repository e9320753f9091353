"""Ranks sharing tensor-parallel engines (`EngineGroup`) on four gloo processes, without vLLM.

Groups of two: each follower must replay exactly its leader's engine calls (the leader's requests,
in the leader's order, even when the leader calls from several threads), a rollout must run the
search once per group and split its samples, and a follower calling another engine than its leader
must fail loudly. The engines are recording stand-ins (the real ones: tests/test_vllm.py).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mars2.generation.engine_group import EngineGroup
from mars2.training.rollout import RolloutEngine, StepData
from tests.ranks import free_port

WORLD, SIZE = 4, 2


class _Rollout(RolloutEngine):
    """`run` generates twice through the group and returns five samples per agent."""

    def __init__(self, group: EngineGroup) -> None:
        self.group, self.searched = group, []

    def run(self, step: int, generators: Any, rank: int = 0, world: int = 1, overlong: Any = None,
            frozen: Any = ()) -> StepData:  # fmt: skip
        self.searched.append((rank, world))
        for agent in ("a", "b"):
            self.group.call(agent, [step, rank])
        return StepData(step, ["tree"], {"a": list(range(5)), "b": []}, {"rank": float(rank)})  # type: ignore[list-item]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    group = EngineGroup(SIZE)
    calls: list[tuple[str, Any]] = []
    for key in ("a", "b"):
        group.register(key, lambda payload, key=key: calls.append((key, payload)) or [key, payload])
    result: dict[str, Any] = {"leader": group.is_leader, "index": group.index}
    # every rank calls: the leader's payload wins
    result["call"] = group.call("a", ["from", rank])
    # a rollout: the leader calls from two threads at once, the follower serves
    if group.is_leader:
        threads = [threading.Thread(target=lambda k=k: [group.call(k, [k, i]) for i in range(3)])
                   for k in ("a", "b")]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        group.release()
    else:
        result["served"] = group.serve()
    rollout = _Rollout(group)
    data = rollout.run_in_group(7, {}, group)
    result.update(calls=list(calls), searched=rollout.searched, samples=data.samples, trees=data.trees,
                  metrics=data.metrics)  # fmt: skip

    class _Failing(_Rollout):
        def run(self, *args: Any, **kwargs: Any) -> StepData:
            self.group.call("a", ["before", "failing"])
            raise ValueError("the search failed")

    try:  # a leader whose search fails: the follower fails too instead of waiting
        _Failing(group).run_in_group(8, {}, group)
    except (ValueError, RuntimeError) as err:
        result["failed"] = str(err)
    result["last_call"] = calls[-1]
    try:  # a follower calling another engine than its leader
        group.call("a" if group.is_leader else "b", [])
    except RuntimeError as err:
        result["error"] = str(err)
    torch.save(result, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_followers_replay_their_leaders_calls_and_get_a_share(tmp_path: Path) -> None:
    out = str(tmp_path / "rank")
    mp.spawn(_worker, args=(free_port(), out), nprocs=WORLD)
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]
    assert [r["leader"] for r in results] == [True, False, True, False]
    assert [r["index"] for r in results] == [0, 0, 1, 1]
    for leader, follower in (results[0:2], results[2:4]):
        base = 2 * leader["index"]
        assert leader["call"] == follower["call"] == ["a", ["from", base]]
        assert follower["served"] == 6
        # the same calls, in the same order, on both ranks of a group (threads serialised)
        assert follower["calls"] == leader["calls"] and len(leader["calls"]) == 1 + 6 + 2
        # the search ran once per group, as rank `index` of 2 groups; the samples were split
        assert leader["searched"] == [(leader["index"], 2)] and follower["searched"] == []
        assert leader["samples"] == {"a": [0, 2, 4], "b": []}
        assert follower["samples"] == {"a": [1, 3], "b": []}
        assert leader["trees"] == ["tree"] and follower["trees"] == []
        assert follower["metrics"] == leader["metrics"] == {"rank": float(leader["index"])}
        assert leader["failed"] == "the search failed"
        assert "failed during step 8's rollout" in follower["failed"]
        assert follower["last_call"] == ("a", ["before", "failing"])  # replayed before the failure
        assert "error" not in leader
        assert "called engine 'b' while its leader (rank" in follower["error"]


def test_a_group_size_must_divide_the_ranks() -> None:
    with pytest.raises(ValueError, match="must divide the number of trainer ranks"):
        EngineGroup(3)  # one process: world 1
