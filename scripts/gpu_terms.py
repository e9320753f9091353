"""The `terms` step of scripts/gpu_check.sh: the 32B plan's unguarded assumptions (issue #43), each
measured on the device next to what the plan assumes. Writes terms.json; the verdict is
`python scripts/gpu_check.py terms terms.json` (one line: measured vs planned per term).

python scripts/gpu_terms.py --out terms.json --tiny .cache/tiny_models [--device cuda|cpu] [--small]

Terms (each a record: term, planned, measured, unit, ok, note):
  sharding   a tiny_qwen3 policy fully_shard-ed on a one-rank mesh: every parameter a sharded
             DTensor, local bytes = full / world (`mars2.training.sharding.sharding_problems`)
  sync       the streamed weight sync (`streamed_weights`) of that sharded policy: the largest
             rise of allocated memory while it runs, against the largest single tensor (the plan's
             "one layer during a streamed sync"); CUDA only (on CPU: the largest tensor yielded)
  k3_kl      the KL term with a masked position 100 nats off, on the device: finite
  logprobs   the chunked bf16 head with a bias (4096 x 32000; --small: 256 x 2000) against fp64:
             worst log-prob error against the stated bound, and the step's peak memory against
             the plan's chunked-logits term
  allocator  PYTORCH_CUDA_ALLOC_CONF under trainer=gpu, and the fragmentation seen over this
             script (1 - peak allocated / peak reserved) against the plan's 8% reserve
  engines    the planned vLLM engine lengths of experiment=qwen3_32b_pair (max_model_len); not
             measured here: the lent machine has no vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

GIB = 1024**3
MIB = 1024**2


def _record(term: str, planned: Any, measured: Any, unit: str, ok: bool | None, note: str) -> dict[str, Any]:  # fmt: skip
    return {"term": term, "planned": planned, "measured": measured, "unit": unit, "ok": ok,
            "note": note}  # fmt: skip


class Peak:
    """Allocated-memory counters of the device (CUDA), or nothing on CPU."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device, self.cuda = device, device.type == "cuda"
        self.torch = torch

    def reset(self) -> float:
        if not self.cuda:
            return 0.0
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        return float(self.torch.cuda.memory_allocated(self.device))

    def rise(self, base: float) -> float | None:
        if not self.cuda:
            return None
        self.torch.cuda.synchronize(self.device)
        return float(self.torch.cuda.max_memory_allocated(self.device)) - base


def sharding_and_sync(tiny: Path, device: Any, peak: Peak) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from mars2.generation.vllm_backend import streamed_weights
    from mars2.training.sharding import shard_model, sharding_problems

    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(delete=False)  # noqa: SIM115 - a file:// rendezvous
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(tiny / "tiny_qwen3", dtype=torch.bfloat16)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    shard_model(model, init_device_mesh(device.type, (1,)))
    model.to(device)
    problems = sharding_problems(model, 1, "tiny_qwen3 policy")
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters()
                if hasattr(p, "to_local"))  # fmt: skip
    records = [
        _record("sharding", round(full_bytes / MIB, 3), round(local / MIB, 3), "MiB local",
                not problems, "; ".join(problems) or "every parameter a sharded DTensor"),
    ]  # fmt: skip
    base = peak.reset()
    biggest_yielded = 0
    for _, tensor in streamed_weights(model):
        biggest_yielded = max(biggest_yielded, tensor.numel() * tensor.element_size())
    rise = peak.rise(base)
    if rise is None:  # CPU: what the sync handed over, not what it held
        ok = biggest_yielded == largest
        records.append(_record("sync", round(largest / MIB, 3), round(biggest_yielded / MIB, 3),
                               "MiB largest tensor yielded", ok,
                               "CPU: no allocator peak; the peak rise is measured on CUDA"))  # fmt: skip
    else:
        # one full tensor and its merged copy (streamed_weights' docstring), plus allocator rounding
        ok = rise <= 2 * largest + 2 * MIB
        records.append(_record("sync", round(largest / MIB, 3), round(rise / MIB, 3),
                               "MiB peak rise during the sync", ok,
                               "planned: one layer (the largest tensor); bound 2x + 2 MiB"))  # fmt: skip
    dist.destroy_process_group()
    return records


def k3(device: Any) -> dict[str, Any]:
    import torch

    from mars2.training.losses import LossConfig, policy_loss

    lp = torch.tensor([[-1.0, -100.5]], device=device)
    ref = torch.tensor([[-1.1, -0.5]], device=device)  # masked position: ref - lp = 100
    mask = torch.tensor([[1.0, 0.0]], device=device)
    loss, _ = policy_loss(lp, lp, torch.ones(1, device=device), mask, LossConfig(beta=0.1),
                          ref_logprobs=ref)  # fmt: skip
    value = float(loss)
    finite = bool(torch.isfinite(loss))
    return _record("k3_kl", "finite", value, "loss", finite,
                   "a masked position at ref - lp = 100 (NaN before #43)")  # fmt: skip


def logprobs(device: Any, peak: Peak, small: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from mars2.models.memory import LOGIT_CHUNK_BYTES
    from mars2.training.logprobs import chunked_logprobs_and_entropy

    hidden_size, vocab, tokens = (256, 2000, 32) if small else (4096, 32000, 1024)
    chunk = tokens // 4
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, hidden_size, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.05).to(device, torch.bfloat16)
    bias = (torch.randn(vocab, generator=gen) * 2).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
    hidden.requires_grad_()
    weight.requires_grad_()
    base = peak.reset()
    got, _ = chunked_logprobs_and_entropy(hidden, weight, targets, 1.0, chunk, bias)
    got.sum().backward()
    rise = peak.rise(base)
    with torch.no_grad():
        logits64 = F.linear(hidden.double(), weight.double(), bias.double())
        ref = torch.log_softmax(logits64, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    bound = 2 * 2**-8 * float(logits64.abs().max())
    error = float((got.detach().double() - ref).abs().max())
    # the plan's chunked term (mars2.models.memory._logit_term) with an fp32 head gradient
    planned = chunk * vocab * LOGIT_CHUNK_BYTES + tokens * hidden_size * 2 + vocab * hidden_size * 4
    note = f"|log p - fp64| {error:.4f} <= bound {bound:.4f} nats"
    ok = error <= bound
    if rise is not None:
        ok = ok and rise <= 1.15 * planned + 2 * vocab * hidden_size  # + the bf16 weight gradient
    return _record("logprobs", round(planned / MIB, 1), None if rise is None else round(rise / MIB, 1),
                   "MiB peak rise of one chunked step", ok,
                   note + ("" if rise is not None else "; CPU: no allocator peak"))  # fmt: skip


def allocator(device: Any) -> dict[str, Any]:
    import torch

    from mars2.training.memory import ALLOC_CONF_ENV, compose

    cfg = compose(["experiment=tiny_pair", "trainer=gpu"])
    wanted = cfg.trainer.get("cuda_alloc_conf")
    present = os.environ.get(ALLOC_CONF_ENV)
    fragmentation = None
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        allocated = stats.get("allocated_bytes.all.peak", 0)
        fragmentation = round(1 - allocated / reserved, 4) if reserved else None
    ok = present == wanted and (fragmentation is None or fragmentation <= 0.08)
    return _record("allocator", 0.08, fragmentation, "1 - peak allocated / peak reserved", ok,
                   f"trainer=gpu sets {wanted!r}; this process has {ALLOC_CONF_ENV}={present!r}")  # fmt: skip


def engines() -> dict[str, Any]:
    from mars2.training.memory import compose, estimate_config

    est = estimate_config(compose(["experiment=qwen3_32b_pair", "memory.gpu=h200"]))
    lines = [" ".join(line.split()) for line in est.report().splitlines()
             if "KV" in line or "engine" in line]  # fmt: skip
    return _record("engines", "; ".join(lines[:4]), None, "planned only", None,
                   "vLLM is not installed on the lent machine: engine lengths are not measured")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", type=Path, required=True, help="the tiny models' folder")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--small", action="store_true", help="a small head (CPU rehearsal)")
    args = parser.parse_args(argv)
    import torch

    from mars2.training.memory import apply_allocator_conf, compose

    # as a GPU run would: the allocator setting before CUDA starts
    apply_allocator_conf(compose(["experiment=tiny_pair", "trainer=gpu"]))
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    peak = Peak(device)
    records: list[dict[str, Any]] = []
    steps = [
        ("sharding", lambda: sharding_and_sync(args.tiny, device, peak)),
        ("k3_kl", lambda: [k3(device)]),
        ("logprobs", lambda: [logprobs(device, peak, args.small)]),
        ("allocator", lambda: [allocator(device)]),
        ("engines", lambda: [engines()]),
    ]
    for term, step in steps:
        try:
            records.extend(step())
        except Exception as err:  # one term that breaks is reported, the others still run
            records.append(_record(term, None, None, "", False, f"{type(err).__name__}: {err}"))
    report = {"device": str(device), "gpu": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "the CPU", "terms": records}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1))
    for r in records:
        print(f"TERM {r['term']}: measured {r['measured']} vs planned {r['planned']} "
              f"({r['unit']}) {'ok' if r['ok'] else 'n/a' if r['ok'] is None else 'OFF'}; {r['note']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
