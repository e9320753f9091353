"""One training step's memory, measured against the estimate of `mars2.training.memory`.

Each case is a training config composed like a run's: the shipped Qwen3 agent (bf16, gradient
checkpointing, the paper's GSPO loss with a k3 KL) with the model swapped for a random-initialised
one of a named shape (built from a config.json, nothing downloaded), LoRA r=64 or full
fine-tuning, one sample of `prompt + completion` tokens per micro-batch, the transformers backend
(no vLLM engine, so no engine term). The same composed config gives the prediction
(`estimate_config`) and builds the agent that is measured. A measurement runs `optimise_agent`
twice under bf16 autocast (as `trainer=gpu`'s bf16-mixed does): the first step creates the
optimizer states, the second is measured (its peak: `torch.cuda.max_memory_allocated`).

python -m mars2.training.calibration --out calibration.json   # every case, on the visible GPU
python -m mars2.training.calibration --shape qwen3-8b --mode lora --completion-tokens 4096
python -m mars2.training.calibration --predict-only --gpu h200  # the prediction side, no GPU
python -m mars2.training.calibration --shape tiny --device cpu --completion-tokens 64  # on CPU

On CPU the step runs too, but only the tensors' bytes (weights, gradients, optimizer states,
reference) are measured; the peak needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mars2.models.memory import GIB, MemoryEstimate

# The agent every case starts from (configs/agent/qwen3_8b.yaml): its dtype, gradient
# checkpointing, loss and optimizer; only the model's shape, LoRA and the lengths change.
AGENT = "qwen3_8b"
# Hugging Face config.json of each shape (Qwen3-1.7B and Qwen3-8B as published; `tiny` for CPU).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {
        "hidden_size": 2048, "num_hidden_layers": 28, "intermediate_size": 6144,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 40960,
        "rope_theta": 1000000,
    },
    "qwen3-8b": {
        "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
        "rope_theta": 1000000,
    },
    "tiny": {
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 1024, "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "rope_theta": 10000,
    },
}  # fmt: skip
MODES = ("lora", "full")
DEFAULT_SHAPES = ("qwen3-1.7b", "qwen3-8b")
DEFAULT_COMPLETIONS = (4096, 16384)
# Cases whose whole estimate exceeds the GPU by more than this are not tried: they cannot fit.
HOPELESS = 1.5


@dataclass(frozen=True)
class Case:
    """One calibration setting."""

    shape: str
    mode: str  # lora | full
    completion_tokens: int
    prompt_tokens: int = 2048
    micro_batch_size: int = 1
    lora_r: int = 64

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}: use one of {sorted(SHAPES)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: use one of {MODES}")
        if min(self.completion_tokens, self.prompt_tokens, self.micro_batch_size) < 1:
            raise ValueError("completion_tokens, prompt_tokens and micro_batch_size must be >= 1")
        if self.mode == "lora" and self.lora_r < 1:
            raise ValueError("lora_r must be >= 1")

    @property
    def label(self) -> str:
        mode = f"lora r={self.lora_r}" if self.mode == "lora" else "full"
        tokens = self.completion_tokens
        size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
        return f"{self.shape} {mode} {size}"


def cases(
    shapes: Sequence[str] = DEFAULT_SHAPES,
    modes: Sequence[str] = MODES,
    completions: Sequence[int] = DEFAULT_COMPLETIONS,
    **settings: Any,
) -> list[Case]:
    """Every combination, smallest model first (LoRA before full fine-tuning, short first)."""
    return [
        Case(shape, mode, tokens, **settings)
        for shape in shapes
        for mode in modes
        for tokens in completions
    ]


def write_model_dir(shape: str, directory: Path, tokenizer_from: Path | None = None) -> Path:
    """`directory/<shape>/config.json` (Qwen3) and, when given, a tokenizer saved beside it."""
    target = directory / shape
    target.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **SHAPES[shape]}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_from is not None and not (target / "tokenizer_config.json").exists():
        from mars2.models.loading import load_tokenizer

        # Only the agent's construction needs a tokenizer; the measured ids are random.
        load_tokenizer(str(tokenizer_from)).save_pretrained(str(target))
    return target


def _gpu_setting(gpu: float | str) -> str:
    return f"{gpu:.3f}" if isinstance(gpu, float) else str(gpu)


def case_overrides(case: Case, model_dir: Path, gpu: float | str) -> list[str]:
    """The Hydra overrides of `case`: one training config for the estimate and the measurement."""
    agent = f"agents.{AGENT}"
    lora = (
        f"{{_target_:mars2.models.loading.LoraSpec,r:{case.lora_r},alpha:{2 * case.lora_r}}}"
        if case.mode == "lora"
        else "null"
    )
    return [
        f"agent=[{AGENT}]",
        "trainer=gpu",
        f"micro_batch_size={case.micro_batch_size}",
        f"memory.gpu={_gpu_setting(gpu)}",
        "memory.gpus_per_node=1",
        f"memory.prompt_tokens={case.prompt_tokens}",
        f"scale.lora={lora}",
        "scale.quantization=null",
        f"{agent}.model.path={model_dir}",
        f"{agent}.model.architecture=null",  # the estimate reads model.path/config.json
        f"+{agent}.model.random_init=true",
        f"{agent}.generation.backend=transformers",
        f"{agent}.generation.max_new_tokens={case.completion_tokens}",
    ]


def case_config(case: Case, model_dir: Path, gpu: float | str) -> DictConfig:
    """The composed training config of `case` (as `mars2-train` would compose it)."""
    from mars2.training.memory import compose

    return compose(case_overrides(case, model_dir, gpu))


def prediction(est: MemoryEstimate) -> dict[str, Any]:
    """The estimate split into the agent's resident terms, its step terms and the per-process
    overhead (terms of no agent: CUDA context, allocator), in GiB."""

    def total(phase: str, agent: bool) -> float:
        return sum(t.gib for t in est.terms if t.phase == phase and (t.agent != "-") == agent)

    return {
        "peak": est.peak,
        "train_peak": est.train_peak,
        "resident": total("resident", True),
        "step": total("train", True),
        "overhead": total("resident", False) + total("train", False),
        "usable": est.cluster.usable_gib,
        "gpu": est.cluster.gpu_gib,
        "fits": est.fits,
        "terms": [
            {"agent": t.agent, "name": t.name, "phase": t.phase, "gib": t.gib} for t in est.terms
        ],
    }


def predict(case: Case, model_dir: Path, gpu: float | str) -> dict[str, Any]:
    """What `mars2.training.memory` estimates for `case` (no GPU, no model)."""
    from mars2.training.memory import estimate_config

    return prediction(estimate_config(case_config(case, model_dir, gpu)))


# -- measurement -------------------------------------------------------------------------------


def synthetic_batches(case: Case, vocab: int, pad_id: int, seed: int = 0) -> list[dict[str, Any]]:
    """One rollout's micro-batches as `mars2.training.batching` packs them: `micro_batch_size`
    samples of exactly `prompt + completion` random tokens, advantage 1 (so the loss has a
    gradient), sampling log-probs present."""
    import torch

    from mars2.generation.base import Completion
    from mars2.rewards.routing import Sample
    from mars2.search.tree import Node
    from mars2.training.batching import micro_batches

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(case.micro_batch_size):
        ids = torch.randint(
            vocab, (case.prompt_tokens + case.completion_tokens,), generator=generator
        )
        completion = Completion(
            text="",
            prompt_token_ids=ids[: case.prompt_tokens].tolist(),
            token_ids=ids[case.prompt_tokens :].tolist(),
            logprobs=[-1.0] * case.completion_tokens,
        )
        node = Node(id=index + 1, parent=0, depth=1, agent=AGENT, completion=completion)
        samples.append(Sample(node=node, tree_index=0, shaped_reward=1.0, advantage=1.0))
    return micro_batches(samples, case.micro_batch_size, pad_id)


def tensor_bytes(agent: Any, optimizer: Any) -> dict[str, float]:
    """GiB held by the agent's tensors: weights (trainable, frozen), gradients, optimizer states
    and the frozen reference; counted from the tensors themselves, so it works on any device."""
    import torch

    def size(tensors: Iterator[Any]) -> float:
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t) or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total / GIB

    params = list(agent.policy.parameters())
    references = [p for ref in agent._reference for p in ref.parameters()]
    states = (v for state in optimizer.state.values() for v in state.values())
    measured = {
        "trainable": size(p for p in params if p.requires_grad),
        "frozen": size(p for p in params if not p.requires_grad),
        "gradients": size(p.grad for p in params),
        "optimizer_states": size(states),
        "reference": size(iter(references)),
    }
    measured["total"] = sum(measured.values())
    return measured


@contextlib.contextmanager
def _autocast(cfg: DictConfig, device: Any) -> Iterator[None]:
    """bf16/fp16 autocast when the trainer's precision is mixed, as Lightning wraps a step."""
    import torch

    precision = str(cfg.trainer.get("precision", ""))
    if "16-mixed" not in precision:
        yield
        return
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    with torch.autocast(device.type, dtype=dtype):
        yield


class CudaCounters:
    """The CUDA caching allocator's statistics of one device, in GiB."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def allocated(self) -> float:
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) / GIB

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> float:
        import torch

        return torch.cuda.max_memory_allocated(self.device) / GIB

    def peak_reserved(self) -> float:
        import torch

        return torch.cuda.max_memory_reserved(self.device) / GIB

    def outside_torch(self) -> float:
        """Device memory in use that the allocator did not reserve: the CUDA context, kernels'
        modules, NCCL (all of this process on a GPU of its own)."""
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) / GIB - torch.cuda.memory_reserved(self.device) / GIB


def measure(
    case: Case, cfg: DictConfig, device: str, counters: CudaCounters | None = None
) -> dict[str, Any]:
    """Build the case's agent on `device` and run two steps; GiB of the second (measured) one.

    On CUDA the allocator's `counters` give the peaks; elsewhere only the tensors are counted
    (a test passes its own counters to run the bookkeeping on the CPU).
    """
    import torch

    from mars2.builders import build_agents
    from mars2.training.agent_module import optimise_agent

    dev = torch.device(device)
    if counters is None and dev.type == "cuda":
        counters = CudaCounters(dev)
    base = counters.allocated() if counters else 0.0
    with dev:  # random weights are created on the device itself
        agent = build_agents(cfg)[AGENT]
    agent.to(dev)
    weights = counters.allocated() - base if counters else None
    optimizer, scheduler = agent.build_optimizer()
    vocab = int(agent.policy.config.vocab_size)
    batches = [
        {k: v.to(dev) for k, v in b.items()}
        for b in synthetic_batches(case, vocab, int(agent.tokenizer.pad_token_id))
    ]

    def step() -> dict[str, float]:
        with _autocast(cfg, dev):
            return optimise_agent(
                agent, optimizer, scheduler, batches, _backward, case.micro_batch_size
            )

    if counters:
        counters.reset_peak()
    step()  # creates the optimizer states: from here on memory is as in every later step
    result: dict[str, Any] = {"device": str(dev), "weights": weights}
    if counters:
        result["resident"] = counters.allocated() - base
        result["first_step_peak_allocated"] = counters.peak_allocated() - base
        counters.reset_peak()
    result["tensors"] = tensor_bytes(agent, optimizer)
    start = time.perf_counter()
    metrics = step()
    if counters:
        after = counters.allocated() - base  # synchronises, so the time below is the step's
    result["step_seconds"] = time.perf_counter() - start
    result["grad_norm"] = metrics.get("grad_norm")
    if counters:
        peak_reserved, outside = counters.peak_reserved(), counters.outside_torch()
        result.update(
            after_step=after,
            peak_allocated=counters.peak_allocated() - base,
            peak_reserved=peak_reserved,
            non_torch=outside,
            device_peak=peak_reserved + outside,
        )
    return result  # the agent and its optimizer go with this frame


def _backward(loss: Any) -> None:
    loss.backward()


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def compare(predicted: dict[str, Any], measured: dict[str, Any] | None) -> dict[str, float]:
    """Measured / predicted ratios: the agent's tensors against its resident terms, and on CUDA
    the allocated peak against the agent's terms and the device's peak against the whole
    estimate."""
    if not measured:
        return {}
    ratios = {"tensors/resident": measured["tensors"]["total"] / predicted["resident"]}
    if measured.get("peak_allocated") is not None:
        model = predicted["train_peak"] - predicted["overhead"]
        ratios["allocated/agent_terms"] = measured["peak_allocated"] / model
        ratios["device/estimate"] = measured["device_peak"] / predicted["train_peak"]
    return ratios


def describe(record: dict[str, Any]) -> str:
    """One line per case: predicted against measured GiB."""
    p, m = record["predicted"], record.get("measured")
    head = (
        f"{record['case']}: predicted {p['train_peak']:.4g} GiB (agent resident "
        f"{p['resident']:.4g} + step {p['step']:.4g} + overhead {p['overhead']:.4g})"
    )
    if not m:
        return f"{head}; {record['status']}"
    parts = [f"tensors {m['tensors']['total']:.4g} vs resident {p['resident']:.4g}"]
    if m.get("peak_allocated") is not None:
        parts.append(
            f"peak allocated {m['peak_allocated']:.4g} vs agent terms "
            f"{p['train_peak'] - p['overhead']:.4g}; device peak {m['device_peak']:.4g} "
            f"(reserved {m['peak_reserved']:.4g} + outside torch {m['non_torch']:.4g}) vs "
            f"{p['train_peak']:.4g}"
        )
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in record["ratios"].items())
    return f"{head}; measured {'; '.join(parts)} [{ratios}] in {m['step_seconds']:.1f}s"


def run_case(case: Case, model_dir: Path, gpu: float | str, device: str | None) -> dict[str, Any]:
    """Predict `case` and, when `device` is given, measure it; failures are recorded, not raised
    (an out-of-memory error is itself a result)."""
    cfg = case_config(case, model_dir, gpu)
    from mars2.training.memory import estimate_config

    est = estimate_config(cfg)
    record: dict[str, Any] = {
        "case": case.label,
        "settings": asdict(case),
        "predicted": prediction(est),
        "measured": None,
        "status": "predicted only",
    }
    if device is None:
        return record
    if device.startswith("cuda") and est.train_peak > HOPELESS * est.cluster.gpu_gib:
        record["status"] = (
            f"skipped: the estimate ({est.train_peak:.1f} GiB) is over {HOPELESS}x the GPU"
        )
        return record
    import torch

    try:
        record["measured"] = measure(case, cfg, device)
        record["status"] = "measured"
        if not record["measured"]["grad_norm"]:
            record["status"] = "measured, but the step had no gradient"
    except torch.OutOfMemoryError as err:
        record["status"] = f"out of memory: {str(err).splitlines()[0]}"
    except Exception as err:  # recorded; the next case still runs
        record["status"] = f"error: {type(err).__name__}: {err}"
    finally:
        _release(device)
    record["ratios"] = compare(record["predicted"], record["measured"])
    return record


def environment(device: str | None) -> dict[str, Any]:
    """Date, versions and the GPU, for the calibration table."""
    import peft
    import torch
    import transformers

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": device,
    }
    if device and device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_gib=props.total_memory / GIB)
    return info


def _default_tokenizer() -> Path:
    from mars2.models.tiny import make_tiny_models

    root = Path(os.environ.get("MARS2_TINY_MODELS") or ".cache/tiny_models")
    return make_tiny_models(root)["tiny_qwen3"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mars2.training.calibration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shape",
        action="append",
        choices=sorted(SHAPES),
        help=f"repeatable; default {' '.join(DEFAULT_SHAPES)}",
    )
    parser.add_argument("--mode", action="append", choices=MODES, help="repeatable; default both")
    parser.add_argument(
        "--completion-tokens",
        action="append",
        type=int,
        help=f"repeatable; default {' '.join(map(str, DEFAULT_COMPLETIONS))}",
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--lora-r", type=int, default=64)
    parser.add_argument(
        "--device", default="auto", help="auto (cuda when there is one) | cuda | cpu"
    )
    parser.add_argument("--predict-only", action="store_true", help="no model, no step")
    parser.add_argument("--gpu", help="GiB or h200/h100/...; default: the visible GPU, else h200")
    parser.add_argument(
        "--work", type=Path, help="where the shapes' config.json go (default: a temp dir)"
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a tokenizer for the agents (default: the tiny Qwen3 agent's)",
    )
    parser.add_argument("--out", type=Path, help="JSON of every case, rewritten after each")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="start no new case after this many seconds"
    )
    return parser.parse_args(argv)  # fmt: skip


def _device(choice: str, predict_only: bool) -> str | None:
    if predict_only:
        return None
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {choice}: no CUDA GPU is visible")
    return choice


def _gpu(choice: str | None, device: str | None) -> float | str:
    if choice is not None:
        try:
            return float(choice)
        except ValueError:
            return choice
    if device and device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB
    return "h200"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases; 0 when each was predicted and (unless --predict-only) measured, skipped as
    hopeless or ran out of memory; 1 when one failed otherwise or had no gradient."""
    args = _parse(argv)
    try:
        selected = cases(
            args.shape or DEFAULT_SHAPES,
            args.mode or MODES,
            args.completion_tokens or DEFAULT_COMPLETIONS,
            prompt_tokens=args.prompt_tokens,
            micro_batch_size=args.micro_batch_size,
            lora_r=args.lora_r,
        )
    except ValueError as err:
        print(f"calibration: {err}", file=sys.stderr)
        return 2
    device = _device(args.device, args.predict_only)
    gpu = _gpu(args.gpu, device)
    tokenizer = None if device is None else (args.tokenizer or _default_tokenizer())
    work = args.work or Path(tempfile.mkdtemp(prefix="mars2-calibration-"))
    # Every case is listed from the start, so a run cut short shows what it did not reach.
    records: list[dict[str, Any]] = [{"case": c.label, "status": "pending"} for c in selected]
    report: dict[str, Any] = {"environment": environment(device), "cases": records}

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))

    save()
    start = time.monotonic()
    failed = False
    for index, case in enumerate(selected):
        if args.budget_s is not None and time.monotonic() - start > args.budget_s:
            records[index]["status"] = "not run: out of time budget"
            print(f"CASE {case.label}: {records[index]['status']}", flush=True)
        else:
            model_dir = write_model_dir(case.shape, work, tokenizer)
            records[index] = run_case(case, model_dir, gpu, device)
            failed |= records[index]["status"].startswith(("error", "measured, but"))
            print(f"CASE {describe(records[index])}", flush=True)
        save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
