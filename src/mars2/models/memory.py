"""Per-GPU memory estimate of a training run, decided before a GPU is touched (plain Python).

A run is described by one `AgentPlan` per agent and a `ClusterPlan`; `estimate` returns every
term in GiB, grouped by when it is on the GPU:

- resident: trainable weights, gradients (kept between steps), optimizer states, frozen bases and
  references, the CUDA context. Under a sharded strategy (FSDP) the trainable weights, gradients,
  optimizer states and references are divided by the world size.
- train: activations and logits of one micro-batch of the agent with the largest one (agents step
  one after another; logits a chunk of tokens at a time unless `logprob_chunk_tokens` is 0),
  all-gathered layers under sharding, and the vLLM engines unless they sleep.
- generate: the vLLM engines. vLLM takes `gpu_memory_utilization` of the whole GPU per engine (its
  weights, split over `tensor_parallel_size` ranks, KV cache and work space); sleeping engines are
  woken one at a time. A weight sync streams one tensor at a time into an engine: at most one
  layer's full weights are on the GPU beyond what is resident.

The peak is the larger of resident + train and resident + generate. The byte counts per element
are stated next to each term; they follow what the code in this package allocates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Memory torch reports for a whole device (torch.cuda.get_device_properties(..).total_memory).
GPU_GIB = {"h100": 79.2, "h200": 139.8, "a100": 79.2, "l40s": 44.4}
# CUDA context, NCCL buffers and the allocator's own blocks, per process.
CONTEXT_GIB = 2.0
# vLLM's work space besides weights and KV cache (sampler, CUDA graphs), per engine.
ENGINE_OVERHEAD_GIB = 2.0
# Logits of one micro-batch computed whole (loss.logprob_chunk_tokens=0), bytes per (token x vocab)
# element at the peak of compute_loss: the model's bf16 logits (2), the fp32 log-softmax kept for
# backward (4), and during the entropy and reference passes or in backward up to three more fp32
# copies (12).
LOGIT_BYTES = 18
# Chunked (mars2.training.logprobs), bytes per (chunk x vocab) element: one fp32 block of
# log-probs and one of its exponentials; backward holds less (torch's MemTracker: 8.0 forward,
# 6.1 backward for bf16 weights).
LOGIT_CHUNK_BYTES = 8
DEFAULT_LOGPROB_CHUNK_TOKENS = 1024  # LossConfig.logprob_chunk_tokens's default
# One decoder layer's saved activations in elements per token: about 8 x hidden (norms,
# q/k/v/o, residuals) plus 4 x intermediate (gate, up, activation, product); flash/sdpa attention
# keeps no seq x seq matrix.
LAYER_HIDDEN_FACTOR = 8
LAYER_INTERMEDIATE_FACTOR = 4
# bitsandbytes NF4: half a byte per weight plus block scales (double-quantised: ~0.127 bit).
NF4_BYTES = 0.5 + 0.127 / 8
LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MemoryBudgetError(RuntimeError):
    """A run whose estimated per-GPU memory exceeds the GPU; the message names terms and knobs."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen-style decoder that memory depends on."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    params: int | None = None  # declared total; computed from the shapes when absent

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config.json dict, or the same keys declared in an agent yaml."""
        try:
            hidden = int(data["hidden_size"])
            heads = int(data["num_attention_heads"])
            layers = int(data.get("num_hidden_layers", data.get("num_layers", 0)))
            shape = cls(
                hidden_size=hidden,
                num_layers=layers,
                intermediate_size=int(data["intermediate_size"]),
                vocab_size=int(data["vocab_size"]),
                num_attention_heads=heads,
                num_kv_heads=int(
                    data.get("num_key_value_heads") or data.get("num_kv_heads") or heads
                ),
                head_dim=int(data.get("head_dim") or hidden // heads),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                params=int(data["params"]) if data.get("params") else None,
            )
        except KeyError as err:
            raise ValueError(f"model shape lacks {err.args[0]!r}: {sorted(data)}") from err
        if shape.num_layers <= 0:
            raise ValueError("model shape needs num_hidden_layers (or num_layers) > 0")
        return shape

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelShape | None:
        """Read `path/config.json` when it exists locally (no hub access); None otherwise."""
        config = Path(path).expanduser() / "config.json"
        if not config.is_file():
            return None
        data = json.loads(config.read_text())
        data = data.get("text_config", data)
        return cls.from_mapping(data)

    def _projections(self) -> dict[str, tuple[int, int]]:
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        i = self.intermediate_size
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip

    @property
    def linear_params(self) -> int:
        """Weights of the decoder layers' linear projections (what 4-bit quantisation shrinks)."""
        per_layer = sum(a * b for a, b in self._projections().values())
        return per_layer * self.num_layers

    @property
    def layer_params(self) -> int:
        return self.linear_params // self.num_layers + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the output head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def total_params(self) -> int:
        if self.params is not None:
            return self.params
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.linear_params + self.embedding_params + norms

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters: r x (in + out) per targeted projection per layer."""
        shapes = self._projections()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(f"unknown LoRA target modules {unknown}: use {sorted(shapes)}")
        return r * sum(sum(shapes[t]) for t in targets) * self.num_layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class EnginePlan:
    """One vLLM engine on every rank."""

    gpu_memory_utilization: float
    sleep: bool
    max_model_len: int
    key: str  # agents whose engines share this key share one engine (shared-base LoRA)
    tensor_parallel_size: int = 1  # ranks that share one engine, each holding 1/k of its weights

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")


@dataclass(frozen=True)
class AgentPlan:
    """What one agent puts on each GPU."""

    name: str
    shape: ModelShape
    dtype: str = "bfloat16"
    lora_r: int | None = None  # None: full fine-tuning
    lora_targets: tuple[str, ...] = LORA_TARGETS_DEFAULT
    quantization: str | None = None  # None | 4bit | 8bit (base of a LoRA agent)
    optimizer: str = "adamw"  # adamw | adamw8bit
    reference: bool = False  # a frozen copy for the KL term (full fine-tuning with beta > 0)
    gradient_checkpointing: bool = True
    micro_batch_size: int = 1
    seq_len: int = 2048  # prompt + completion tokens of one training sample
    mixed_precision: bool = False  # activations in 16 bit whatever the weights' dtype (autocast)
    engine: EnginePlan | None = None
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS  # 0: whole [tokens, vocab] logits

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.quantization not in (None, "4bit", "8bit"):
            raise ValueError(f"unknown quantization {self.quantization!r}")
        if self.quantization and self.lora_r is None:
            raise ValueError(f"{self.name}: a quantised base trains only through LoRA")
        if self.optimizer not in ("adamw", "adamw8bit"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}")
        if self.logprob_chunk_tokens < 0:
            raise ValueError("logprob_chunk_tokens must be >= 0")

    @property
    def sharded_base(self) -> bool:
        """Whether FSDP can shard this agent's weights (a bitsandbytes 4/8-bit base cannot)."""
        return self.quantization is None


@dataclass(frozen=True)
class ClusterPlan:
    """The GPUs a run gets."""

    gpu_gib: float
    world_size: int = 1
    sharded: bool = False  # FSDP: trainable state and references divided over the world
    usable_fraction: float = 0.92  # the rest is left for allocator fragmentation

    @property
    def usable_gib(self) -> float:
        return self.gpu_gib * self.usable_fraction


@dataclass(frozen=True)
class Term:
    agent: str
    name: str
    gib: float
    phase: str  # resident | train | generate
    knob: str = ""


@dataclass
class MemoryEstimate:
    cluster: ClusterPlan
    terms: list[Term] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # engines that cannot start at all
    engines: list[str] = field(default_factory=list)  # per engine: KV-cache tokens, concurrency

    def phase(self, name: str) -> float:
        return sum(t.gib for t in self.terms if t.phase == name)

    @property
    def train_peak(self) -> float:
        return self.phase("resident") + self.phase("train")

    @property
    def generate_peak(self) -> float:
        return self.phase("resident") + self.phase("generate")

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.generate_peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.cluster.usable_gib and not self.problems

    def biggest(self, count: int = 3) -> list[Term]:
        """The largest terms of the phase that sets the peak (resident terms included)."""
        phase = "train" if self.train_peak >= self.generate_peak else "generate"
        pool = [t for t in self.terms if t.phase in ("resident", phase)]
        return sorted(pool, key=lambda t: -t.gib)[:count]

    def report(self) -> str:
        c = self.cluster
        lines = [
            f"per-GPU memory estimate ({c.world_size} GPU(s) of {c.gpu_gib:.1f} GiB, "
            f"{'sharded' if c.sharded else 'replicated'} training state):",
            f"  {'agent':<20} {'term':<38} {'phase':<9} {'GiB':>8}",
        ]
        for t in self.terms:
            lines.append(f"  {t.agent:<20} {t.name:<38} {t.phase:<9} {t.gib:8.1f}")
        lines.append(
            f"  peak {self.peak:.1f} GiB (train {self.train_peak:.1f}, generate "
            f"{self.generate_peak:.1f}) of {c.usable_gib:.1f} usable: "
            + ("fits" if self.fits else "DOES NOT FIT")
        )
        lines.extend(f"  engine {e}" for e in self.engines)
        lines.extend(f"  problem: {p}" for p in self.problems)
        return "\n".join(lines)

    def refusal(self) -> str:
        """Why the run cannot fit and what to change."""
        parts = [
            f"the run needs about {self.peak:.1f} GiB per GPU but {self.cluster.usable_gib:.1f} "
            f"GiB are usable ({self.cluster.gpu_gib:.1f} GiB GPU)."
        ]
        parts.extend(self.problems)
        parts.append("Biggest terms:")
        for t in self.biggest():
            parts.append(f"  {t.gib:6.1f} GiB  {t.agent}: {t.name} -> {t.knob}")
        parts.append(
            "Print the whole estimate with `python -m mars2.training.memory <overrides>`; "
            "memory.check=false skips this check."
        )
        return "\n".join(parts)


def _gib(n_bytes: float) -> float:
    return n_bytes / GIB


def _trainable_terms(plan: AgentPlan, cluster: ClusterPlan) -> list[Term]:
    shape, b = plan.shape, DTYPE_BYTES[plan.dtype]
    shard = cluster.world_size if cluster.sharded and plan.sharded_base else 1
    terms: list[Term] = []
    if plan.lora_r is None:
        n = shape.total_params / shard
        terms.append(Term(plan.name, f"weights ({plan.dtype})", _gib(n * b), "resident",
                          "LoRA/QLoRA (scale.lora, scale.quantization) or trainer=fsdp"))  # fmt: skip
        grad_dtype_bytes = b
        state_bytes = 2 * (1 if plan.optimizer == "adamw8bit" else b)
    else:
        base = shape.total_params
        if plan.quantization is None:
            base_bytes: float = base * b
        else:
            per = NF4_BYTES if plan.quantization == "4bit" else 1.0
            base_bytes = shape.linear_params * per + (base - shape.linear_params) * b
        label = f"frozen base ({plan.quantization or plan.dtype})"
        terms.append(Term(plan.name, label, _gib(base_bytes / shard), "resident",
                          "trainer=fsdp (shards it) or scale.quantization=4bit (QLoRA)"))  # fmt: skip
        # peft keeps adapters in fp32 even on a bf16 base; FSDP shards them with their layers.
        n = shape.lora_params(plan.lora_r, plan.lora_targets) / shard
        terms.append(Term(plan.name, f"LoRA r={plan.lora_r} weights (fp32)", _gib(n * 4),
                          "resident", "scale.lora.r"))  # fmt: skip
        grad_dtype_bytes = 4
        state_bytes = 2 * (1 if plan.optimizer == "adamw8bit" else 4)
    terms.append(Term(plan.name, "gradients", _gib(n * grad_dtype_bytes), "resident",
                      "LoRA/QLoRA (scale.lora) or trainer=fsdp"))  # fmt: skip
    terms.append(Term(plan.name, f"optimizer states ({plan.optimizer})", _gib(n * state_bytes),
                      "resident", "LoRA (scale.lora), trainer=fsdp, or optim.optimizer=adamw8bit"))  # fmt: skip
    if plan.reference and plan.lora_r is None:
        terms.append(Term(plan.name, f"reference ({plan.dtype})",
                          _gib(shape.total_params / shard * b), "resident",
                          "LoRA (the base is the reference), trainer=fsdp, or loss.beta=0"))  # fmt: skip
    return terms


def _step_terms(plan: AgentPlan, cluster: ClusterPlan) -> list[Term]:
    """What one micro-batch of this agent adds while it trains."""
    shape, tokens = plan.shape, plan.micro_batch_size * plan.seq_len
    compute = 2 if plan.dtype != "float32" or plan.quantization or plan.mixed_precision else 4
    layer = tokens * (
        LAYER_HIDDEN_FACTOR * shape.hidden_size
        + LAYER_INTERMEDIATE_FACTOR * shape.intermediate_size
    )
    if plan.gradient_checkpointing:
        activations = (shape.num_layers * tokens * shape.hidden_size + layer) * compute
    else:
        activations = shape.num_layers * layer * compute
    knob = "micro_batch_size, generation.max_new_tokens (sequence length)"
    terms = [
        Term(plan.name, f"activations ({tokens} tokens)", _gib(activations), "train",
             knob + ("" if plan.gradient_checkpointing else ", model.gradient_checkpointing=true")),
        _logit_term(plan, tokens, compute, knob),
    ]  # fmt: skip
    if cluster.sharded and plan.sharded_base:
        gathered = (shape.embedding_params + 2 * shape.layer_params) * DTYPE_BYTES[plan.dtype]
        terms.append(Term(plan.name, "all-gathered layers (FSDP)", _gib(gathered), "train",
                          "more GPUs do not shrink this"))  # fmt: skip
    return terms


def _logit_term(plan: AgentPlan, tokens: int, compute: int, knob: str) -> Term:
    """Logits and log-probs of one micro-batch: whole, or one chunk of tokens at a time."""
    shape = plan.shape
    if not plan.logprob_chunk_tokens:
        return Term(plan.name, "logits and log-probs", _gib(tokens * shape.vocab_size * LOGIT_BYTES),
                    "train", knob + ", loss.logprob_chunk_tokens (chunks)")  # fmt: skip
    chunk = min(plan.logprob_chunk_tokens, tokens)
    # one chunk's blocks, the final hidden states the chunks read (kept for backward) and, when
    # the output head trains, its fp32 gradient accumulator
    size = chunk * shape.vocab_size * LOGIT_CHUNK_BYTES + tokens * shape.hidden_size * compute
    if plan.lora_r is None:
        size += shape.vocab_size * shape.hidden_size * 4
    return Term(plan.name, "logits and log-probs", _gib(size), "train",
                "loss.logprob_chunk_tokens")  # fmt: skip


def _engine_terms(plans: list[AgentPlan], cluster: ClusterPlan, est: MemoryEstimate) -> None:
    engines: dict[str, list[AgentPlan]] = {}
    for plan in plans:
        if plan.engine is not None:
            engines.setdefault(plan.engine.key, []).append(plan)
    sizes: list[tuple[float, bool, str]] = []
    for key, members in engines.items():
        first = members[0]
        engine = first.engine
        assert engine is not None
        budget = engine.gpu_memory_utilization * cluster.gpu_gib
        b = DTYPE_BYTES[first.dtype if first.dtype != "float32" else "bfloat16"]
        tp = engine.tensor_parallel_size
        # tensor parallelism splits the weights and the KV heads (a KV head is replicated on
        # ranks beyond the number of heads)
        weights = _gib(first.shape.total_params * b / tp)
        kv_share = math.ceil(first.shape.num_kv_heads / tp) / first.shape.num_kv_heads
        kv_one = _gib(first.shape.kv_bytes_per_token(b) * engine.max_model_len * kv_share)
        # LoRA agents served by adapter: one slot per agent on this engine, in the engine's dtype
        adapters = _gib(sum(p.shape.lora_params(p.lora_r, p.lora_targets) * b / tp for p in members
                            if p.lora_r is not None and engine.key != p.name))  # fmt: skip
        need = weights + kv_one + adapters + ENGINE_OVERHEAD_GIB
        # what is left for the KV cache, in tokens, and how many full-length sequences fit at
        # once: more in flight than that and vLLM queues or pre-empts (a speed cost, not memory)
        kv_token = _gib(first.shape.kv_bytes_per_token(b) * kv_share)
        kv_tokens = max(0, int((budget - weights - adapters - ENGINE_OVERHEAD_GIB) / kv_token))
        est.engines.append(
            f"{key}: KV cache for {kv_tokens} tokens = {kv_tokens // engine.max_model_len} "
            f"sequences of max_model_len={engine.max_model_len} at once"
        )
        if budget < need:
            est.problems.append(
                f"vLLM engine of {key}: gpu_memory_utilization={engine.gpu_memory_utilization} "
                f"gives {budget:.1f} GiB but its weights ({weights:.1f} + {adapters:.1f} in "
                f"adapters), KV cache for one "
                f"{engine.max_model_len}-token sequence ({kv_one:.1f}) and work space need "
                f"{need:.1f} GiB: raise scale.gpu_memory_utilization to at least "
                f"{math.ceil(need / cluster.gpu_gib * 100) / 100:.2f} or lower max_model_len"
            )
        sizes.append((budget, engine.sleep, "+".join(p.name for p in members)))
    asleep = [s for s in sizes if s[1]]
    awake = [s for s in sizes if not s[1]]
    knob = "scale.gpu_memory_utilization, scale.enable_sleep_mode=true"
    for budget, _, name in awake:
        label = "vLLM engine (awake while training)"
        est.terms.append(Term(name, label, budget, "train", knob))
        est.terms.append(Term(name, "vLLM engine", budget, "generate", knob))
    # A sync streams full tensors into an engine one at a time (gathered from shards under FSDP,
    # LoRA merged in); vLLM may hold a layer's worth while it loads: one layer's full weights.
    # Shared-base engines load the adapter from disk instead.
    synced = [p for p in plans if p.engine is not None and p.engine.key == p.name]
    if synced:
        big = max(synced, key=lambda p: _largest_unit(p.shape))
        size = _gib(_largest_unit(big.shape) * DTYPE_BYTES[big.dtype])
        est.terms.append(Term(big.name, "one layer during a streamed sync", size,
                              "generate", "shared-base LoRA (scale.shared_base) syncs adapters"))  # fmt: skip
    if asleep:  # woken one at a time, released while the trainer runs
        budget, _, name = max(asleep)
        est.terms.append(
            Term(name, "vLLM engine (largest; others asleep)", budget, "generate", knob)
        )


def _largest_unit(shape: ModelShape) -> int:
    """Parameters of the largest piece a sync holds whole: a decoder layer or the embedding."""
    return max(shape.layer_params, shape.vocab_size * shape.hidden_size)


def estimate(plans: list[AgentPlan], cluster: ClusterPlan) -> MemoryEstimate:
    """Every per-GPU term of a run; see the module docstring for the model."""
    if not plans:
        raise ValueError("no agents to estimate")
    if cluster.world_size < 1 or cluster.gpu_gib <= 0:
        raise ValueError("a cluster needs world_size >= 1 and gpu_gib > 0")
    est = MemoryEstimate(cluster)
    est.terms.append(Term("-", "CUDA context, NCCL, allocator", CONTEXT_GIB, "resident"))
    for plan in plans:
        est.terms.extend(_trainable_terms(plan, cluster))
    # Agents step one after another: only the largest micro-batch is on the GPU at a time.
    steps = [_step_terms(plan, cluster) for plan in plans]
    est.terms.extend(max(steps, key=lambda ts: sum(t.gib for t in ts)))
    _engine_terms(plans, cluster, est)
    return est


def check(est: MemoryEstimate) -> None:
    """Raise `MemoryBudgetError` with the refusal message when the estimate does not fit."""
    if not est.fits:
        raise MemoryBudgetError(est.refusal())
