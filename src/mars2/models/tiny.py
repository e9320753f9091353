"""Tiny heterogeneous agents for CPU tests and the demo, built offline.

Two causal LMs of different architectures (Qwen3, Llama), each with its own byte-level BPE
tokenizer trained on local Python source and its own chat template. They are saved with
`save_pretrained` and loaded back through `AutoModelForCausalLM` / `AutoTokenizer`, the same path
a real checkpoint takes.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """What distinguishes one tiny agent: architecture, tokenizer and chat format."""

    name: str
    architecture: str
    vocab_size: int
    specials: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None
    chat_template: str
    corpus_stride: int  # which source files its tokenizer sees: each has its own corpus


TINY_SPECS = (
    TinySpec("tiny_qwen3", "qwen3", 2048, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
             "<|im_end|>", "<|endoftext|>", None, QWEN_TEMPLATE, 2),
    TinySpec("tiny_llama", "llama", 1536,
             ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
             "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>", LLAMA_TEMPLATE, 3),
)  # fmt: skip


def local_python_sources(limit: int = 240) -> list[Path]:
    """Python source files of the standard library, in a fixed order (training text, offline)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size < 200_000)
    return files[:limit]


def train_tokenizer(spec: TinySpec, sources: list[Path]):  # type: ignore[no-untyped-def]
    """A byte-level BPE tokenizer for `spec`, trained on `sources`, as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [
        p.read_text(encoding="utf-8", errors="replace") for p in sources[:: spec.corpus_stride]
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=spec.eos,
        pad_token=spec.pad,
        bos_token=spec.bos,
        chat_template=spec.chat_template,
        model_max_length=2048,
    )


def build_model(spec: TinySpec, tokenizer, seed: int):  # type: ignore[no-untyped-def]
    """A randomly initialised causal LM of `spec.architecture` sized for CPU tests."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "num_attention_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config: Any
    if spec.architecture == "qwen3":
        config = Qwen3Config(intermediate_size=192, num_hidden_layers=2, num_key_value_heads=1,
                             tie_word_embeddings=True, **common)  # fmt: skip
    else:
        config = LlamaConfig(intermediate_size=160, num_hidden_layers=3, num_key_value_heads=2,
                             tie_word_embeddings=False, **common)  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def make_tiny_models(out_dir: str | Path, seed: int = 0, force: bool = False) -> dict[str, Path]:
    """Build and save every tiny agent under `out_dir`; skip those already complete."""
    out = Path(out_dir)
    sources = local_python_sources()
    paths = {}
    for index, spec in enumerate(TINY_SPECS):
        target = out / spec.name
        marker = target / "mars2_tiny.json"
        paths[spec.name] = target
        if marker.exists() and not force:
            continue
        target.mkdir(parents=True, exist_ok=True)
        tokenizer = train_tokenizer(spec, sources)
        model = build_model(spec, tokenizer, seed + index)
        tokenizer.save_pretrained(target)
        model.save_pretrained(target)
        n_params = sum(p.numel() for p in model.parameters())
        marker.write_text(json.dumps({"name": spec.name, "params": n_params, "seed": seed + index}))
        os.sync()
    return paths
