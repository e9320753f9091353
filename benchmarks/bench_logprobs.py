"""Peak memory of one loss step on a 16,384-token completion: chunked log-probs vs whole logits.

A tiny Qwen3 (hidden 64, 2 layers) with Qwen3's 151,936-token vocabulary, one sequence of a
64-token prompt and a 16,384-token completion, `AgentModule.compute_loss` (the paper's GSPO loss
with truncated importance sampling) and its backward, once with `loss.logprob_chunk_tokens=1024`
and once with 0: the whole [tokens, vocab] logits at once, the computation before chunking.

Memory is counted by torch's own tracker (`torch.distributed._tools.mem_tracker.MemTracker`: every
tensor alive at each op, autograd's saved tensors included), each run in its own subprocess. The
whole-logits run at 16,384 tokens needs ~40 GiB, more than a CPU test machine has, so it runs on
fake tensors (`FakeTensorMode`: real shapes and dtypes, the real ops' outputs, no storage). Both
paths are measured both ways at 2,048 tokens, and the chunked path at 16,384 too, so the bench
shows that the fake count equals the real one; each real run also reports its growth in peak RSS.
The model attends with plain causal SDPA (exact for one unpadded sequence), because Hugging Face
builds an explicit mask under fake tensors and real and fake runs would then attend differently.

The gradient check runs the real model: the chunked gradient (hidden states and output head)
against the whole-logits one, at 2,048 tokens whole, and at 16,384 tokens with the reference
computed 2,048 rows at a time (log-softmax is per row, so only the summation order of the head's
gradient differs from a whole run).

    python benchmarks/bench_logprobs.py [--tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151_936
PROMPT = 64
CHUNK = 1024
CALIBRATION_TOKENS = 2048
ATTENTION = "mars2_causal_sdpa"


def _register_causal_attention() -> None:
    """Causal SDPA without a mask tensor, under real and fake tensors alike (no padding here)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def attend(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
        return sdpa_attention_forward(module, q, k, v, None, **kw)

    AttentionInterface.register(ATTENTION, attend)
    AttentionMaskInterface.register(ATTENTION, lambda *a, **k: None)


def build_model_dir(root: Path, tokens: int) -> Path:
    """The tiny Qwen3 with a 151,936-token vocabulary, saved with tiny_qwen3's tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from mars2.models.tiny import make_tiny_models

    tiny = Path(os.environ.get("MARS2_TINY_MODELS", REPO / ".cache" / "tiny_models"))
    source = make_tiny_models(tiny)["tiny_qwen3"]
    target = root / "tiny_qwen3_152k"
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if "token" in item.name or item.name.endswith(".jinja"):
            shutil.copy(item, target / item.name)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=2, head_dim=32,
        intermediate_size=192, num_hidden_layers=2, num_key_value_heads=1,
        tie_word_embeddings=True, max_position_embeddings=PROMPT + tokens, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    return target


def _agent(model_dir: Path, chunk: int) -> Any:
    from mars2.generation.config import GenerationConfig
    from mars2.models.loading import ModelSpec
    from mars2.training.agent_module import AgentModule
    from mars2.training.losses import LossConfig

    _register_causal_attention()
    loss = LossConfig(variant="gspo", eps_low=3e-4, eps_high=4e-4, tis_cap=2.0,
                      logprob_chunk_tokens=chunk)  # fmt: skip
    spec = ModelSpec(str(model_dir), attn_implementation=ATTENTION)
    return AgentModule("bench", spec, GenerationConfig(backend="vllm"), loss=loss)


def _batch(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    length = PROMPT + tokens
    completion = torch.zeros(1, length - 1)
    completion[:, PROMPT - 1 :] = 1
    return {
        "input_ids": torch.randint(3, VOCAB, (1, length), generator=g),
        "attention_mask": torch.ones(1, length, dtype=torch.long),
        "completion_mask": completion,
        "advantages": torch.tensor([1.0]),
        "truncated": torch.tensor([False]),
        "rollout_logprobs": -torch.rand(1, length - 1, generator=g) * 5,
        "has_rollout_logprobs": torch.tensor([True]),
    }


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def measure(model_dir: Path, tokens: int, chunk: int, fake: bool) -> dict[str, Any]:
    """Peak tensor memory (MiB) of compute_loss + backward; run in its own process."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    agent = _agent(model_dir, chunk)
    batch = _batch(tokens)
    mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else None
    if mode is not None:  # every parameter and buffer swapped for a fake one (ties kept)
        seen: dict[int, Any] = {}
        for module in agent.policy.modules():
            for table, wrap in ((module._parameters, True), (module._buffers, False)):
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in seen:
                        fake_tensor = mode.from_tensor(tensor.detach())
                        seen[id(tensor)] = (
                            torch.nn.Parameter(fake_tensor, requires_grad=tensor.requires_grad)
                            if wrap
                            else fake_tensor
                        )
                    table[name] = seen[id(tensor)]
        batch = {k: mode.from_tensor(v) for k, v in batch.items()}
    tracker = MemTracker()
    tracker.track_external(agent.policy)
    reset = _reset_peak_rss()
    before = _peak_rss_mib()
    began = time.perf_counter()
    with mode if mode is not None else _nothing(), tracker:
        loss, _ = agent.compute_loss(batch)
        loss.backward()
    seconds = time.perf_counter() - began
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**20
    rss = None if fake or not reset else _peak_rss_mib() - before
    return {"peak_mib": peak, "rss_growth_mib": rss, "seconds": seconds}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def grad_diff(model_dir: Path, tokens: int, block: int | None) -> tuple[float, float]:
    """(max |chunked - whole-logits|, max |whole-logits|) over the gradients of the hidden states
    and the output head. `block`: the reference runs that many rows at a time (None: all)."""
    from mars2.models.hidden import forward_with_head, output_head
    from mars2.training.logprobs import chunked_token_logprobs
    from mars2.training.losses import policy_loss, token_logprobs

    agent = _agent(model_dir, CHUNK)
    batch = _batch(tokens, seed=1)
    head = output_head(agent.policy)
    assert head is not None
    with torch.no_grad():
        ids = batch["input_ids"]
        hidden = forward_with_head(agent.policy, head, lambda h: h, ids, batch["attention_mask"])
        hidden = hidden[0, :-1]
    targets, mask = ids[0, 1:], batch["completion_mask"]
    rows = block or len(targets)

    def whole_logits_logprobs(h: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
        logits = torch.nn.functional.linear(h[start : start + rows], weight)
        return token_logprobs(logits, targets[start : start + rows])

    with torch.no_grad():  # the sampler's log-probs: ratio 1, as in a rollout's first update
        old = torch.cat([whole_logits_logprobs(hidden, head.weight, s)
                         for s in range(0, len(targets), rows)]).unsqueeze(0)  # fmt: skip

    def loss_of(logprobs: torch.Tensor) -> torch.Tensor:
        loss, _ = policy_loss(logprobs.unsqueeze(0), old, batch["advantages"], mask,
                              agent.loss_config)  # fmt: skip
        return loss

    h = hidden.clone().requires_grad_(True)
    weight = head.weight.detach().clone().requires_grad_(True)
    loss_of(chunked_token_logprobs(h, weight, targets, 1.0, CHUNK)).backward()
    chunked = (h.grad, weight.grad)

    h = hidden.clone().requires_grad_(True)
    weight = head.weight.detach().clone().requires_grad_(True)
    leaf = old[0].clone().requires_grad_(True)  # the loss's gradient w.r.t. each log-prob
    loss_of(leaf).backward()
    assert leaf.grad is not None
    for start in range(0, len(targets), rows):
        whole_logits_logprobs(h, weight, start).backward(leaf.grad[start : start + rows])
    reference = (h.grad, weight.grad)
    pairs = list(zip(chunked, reference, strict=True))
    return (
        max(float((a - b).abs().max()) for a, b in pairs),
        max(float(b.abs().max()) for _, b in pairs),
    )


def _in_subprocess(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, __file__, "--worker", *args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"bench_logprobs worker {args} failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def run(tokens: int = 16_384) -> dict[str, Any]:
    """Every measurement; each memory run in a fresh subprocess."""
    with tempfile.TemporaryDirectory(prefix="mars2-bench-logprobs-") as root:
        model_dir = build_model_dir(Path(root), tokens)

        def measured(n: int, chunk: int, fake: bool) -> dict[str, Any]:
            return _in_subprocess("measure", str(model_dir), str(n), str(chunk), str(int(fake)))

        calibration = {
            (chunk, fake): measured(CALIBRATION_TOKENS, chunk, fake)
            for chunk in (CHUNK, 0)
            for fake in (False, True)
        }
        chunked = measured(tokens, CHUNK, False)
        chunked_fake = measured(tokens, CHUNK, True)
        full = measured(tokens, 0, True)
        diffs = {
            "whole": _in_subprocess("grad", str(model_dir), str(CALIBRATION_TOKENS), "0"),
            "blocks": _in_subprocess("grad", str(model_dir), str(tokens), str(CALIBRATION_TOKENS)),
        }
    return {
        "tokens": tokens,
        "chunked": chunked,
        "chunked_fake": chunked_fake,
        "full": full,
        "calibration": calibration,
        "diffs": diffs,
        "ratio": full["peak_mib"] / chunked["peak_mib"],
        "max_grad_diff": max(d["diff"] for d in diffs.values()),
    }


def report(result: dict[str, Any]) -> list[str]:
    cal, d = result["calibration"], result["diffs"]
    lines = [
        f"one {result['tokens']}-token completion + {PROMPT}-token prompt, vocabulary {VOCAB}, "
        f"tiny Qwen3 (hidden 64, 2 layers, fp32), GSPO loss forward + backward, chunk {CHUNK}",
        f"  at {CALIBRATION_TOKENS} tokens, real vs fake tensors (MiB): chunked "
        f"{cal[(CHUNK, False)]['peak_mib']:.1f} vs {cal[(CHUNK, True)]['peak_mib']:.1f}, whole "
        f"{cal[(0, False)]['peak_mib']:.1f} vs {cal[(0, True)]['peak_mib']:.1f} "
        f"(peak RSS growth {cal[(CHUNK, False)]['rss_growth_mib'] or float('nan'):.0f} and "
        f"{cal[(0, False)]['rss_growth_mib'] or float('nan'):.0f})",
        f"  at {result['tokens']} tokens: chunked {result['chunked']['peak_mib']:.1f} MiB real "
        f"(fake {result['chunked_fake']['peak_mib']:.1f}, peak RSS growth "
        f"{result['chunked']['rss_growth_mib'] or float('nan'):.0f} MiB, "
        f"{result['chunked']['seconds']:.0f} s); whole logits {result['full']['peak_mib']:.1f} "
        "MiB on fake tensors (too large for this machine's RAM)",
        f"  max grad diff: {d['whole']['diff']:.1e} at {CALIBRATION_TOKENS} tokens (whole "
        f"reference; largest gradient {d['whole']['scale']:.1e}), {d['blocks']['diff']:.1e} at "
        f"{result['tokens']} tokens (reference {CALIBRATION_TOKENS} rows at a time; largest "
        f"gradient {d['blocks']['scale']:.1e})",
        f"logprob memory: chunked {result['chunked']['peak_mib']:.0f} MiB vs full "
        f"{result['full']['peak_mib']:.0f} MiB ({result['ratio']:.1f}x less), max grad diff "
        f"{result['max_grad_diff']:.1e}",
    ]
    return lines


def _worker(args: list[str]) -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    kind, model_dir, tokens = args[0], Path(args[1]), int(args[2])
    if kind == "measure":
        out = measure(model_dir, tokens, int(args[3]), bool(int(args[4])))
    else:
        block = int(args[3]) or None
        diff, scale = grad_diff(model_dir, tokens, block)
        out = {"diff": diff, "scale": scale}
    print(json.dumps(out))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16_384)
    args = parser.parse_args()
    print("\n".join(report(run(args.tokens))))


if __name__ == "__main__":
    main()
