"""The streamed weight sync on FSDP2 shards (two gloo CPU ranks; no vLLM: the engine's side is the
consumer of `streamed_weights`, which is all a sync hands it).

Two mutations used to pass the CPU suite and fail only under vLLM: yielding each rank's local
shard instead of the gathered tensor, and gathering every tensor before the first one is yielded
(the memory plan budgets one layer's full weights for a sync, "one layer during a streamed sync"
in `mars2.models.memory`). Here every yielded tensor must be a plain full tensor equal to the
unsharded model's, and the bytes of the tensors the sync holds alive beyond what existed before it
(scanned with the garbage collector at every yield) must never exceed the largest single tensor.
"""

from __future__ import annotations

import copy
import gc
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ranks import on_two_gloo_ranks

pytestmark = pytest.mark.slow


def _storage(o: object) -> tuple[int, int] | None:
    """(data pointer, bytes) of a plain tensor's storage; None for DTensors (their local tensors
    are scanned themselves), meta tensors and other storage-less wrappers."""
    if not isinstance(o, torch.Tensor) or hasattr(o, "placements") or o.is_meta:
        return None
    try:
        s = o.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors() -> list[tuple[int, int]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated module attributes warns
        return [st for st in map(_storage, gc.get_objects()) if st is not None]


def _live_bytes(known: set[int]) -> int:
    """Bytes of the storages held by live tensors that are not in `known`."""
    return sum(dict(st for st in _tensors() if st[0] not in known and st[1]).values())


def _measure(policy: Any, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    from mars2.generation.vllm_backend import streamed_weights

    gc.collect()
    known = {ptr for ptr, _ in _tensors()}  # the expected tensors included
    peak, wrong = 0, []
    for name, tensor in streamed_weights(policy):
        if hasattr(tensor, "placements") or tensor.shape != expected[name].shape:
            wrong.append(f"{name}: {type(tensor).__name__} {tuple(tensor.shape)}")
        elif not torch.allclose(tensor, expected[name], atol=1e-6):
            wrong.append(f"{name}: values differ")
        del tensor  # freed by reference count: no gc.collect() (slow) needed
        # the generator's frame still holds the tensor it just yielded (`full`): count it too
        peak = max(peak, _live_bytes(known))
    largest = max(t.numel() * t.element_size() for t in expected.values())
    return {"peak": peak, "largest": largest, "wrong": wrong}


def _rank(rank: int, tiny: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from mars2.generation.vllm_backend import merged_weights
    from mars2.models.loading import LoraSpec, ModelSpec, load_policy
    from mars2.training.sharding import shard_model

    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for lora in (False, True):
        torch.manual_seed(0)
        spec = ModelSpec(
            str(Path(tiny) / "tiny_qwen3"), lora=LoraSpec(r=4, alpha=8) if lora else None
        )
        policy = load_policy(spec)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.1)  # a non-zero adapter to merge
        expected = {k: v.clone() for k, v in merged_weights(copy.deepcopy(policy))}
        shard_model(policy, mesh)
        results["lora" if lora else "full"] = _measure(policy, expected)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_streamed_sync_yields_gathered_tensors_one_at_a_time(
    tmp_path: Path, tiny_models_dir: Path
) -> None:
    on_two_gloo_ranks(_rank, str(tiny_models_dir), str(tmp_path))
    for rank in (0, 1):
        for kind, r in json.loads(Path(tmp_path, f"rank{rank}.json").read_text()).items():
            assert r["wrong"] == [], f"rank {rank} {kind}: not the gathered tensors: {r['wrong']}"
            # streamed: only the yielded tensor is alive (<= the largest); gathered up front: the
            # whole model (tiny_qwen3: ~2x its embedding, the largest tensor)
            assert 0 < r["peak"] <= r["largest"], f"rank {rank} {kind}: {r}"
