"""Tiny heterogeneous agents load through the same Auto* path as real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars2.models.loading import LoraSpec, ModelLoadError, ModelSpec, load_policy, load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_tiny_agents_load_with_auto_classes_offline(tiny_models_dir: Path) -> None:
    code = f"""
import json
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {{}}
for name in ("tiny_qwen3", "tiny_llama"):
    tok = AutoTokenizer.from_pretrained("{tiny_models_dir}/" + name)
    model = AutoModelForCausalLM.from_pretrained("{tiny_models_dir}/" + name)
    chat = tok.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False, add_generation_prompt=True)
    out[name] = {{"arch": type(model).__name__, "vocab": tok.get_vocab(), "chat": chat,
                  "params": sum(p.numel() for p in model.parameters()),
                  "head_dim": model.config.head_dim}}
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    qwen, llama = info["tiny_qwen3"], info["tiny_llama"]
    assert qwen["arch"] == "Qwen3ForCausalLM" and llama["arch"] == "LlamaForCausalLM"
    assert qwen["vocab"] != llama["vocab"] and len(qwen["vocab"]) != len(llama["vocab"])
    assert (
        "<|im_start|>assistant" in qwen["chat"] and "<|start_header_id|>assistant" in llama["chat"]
    )
    for agent in (qwen, llama):
        assert 100_000 < agent["params"] < 1_000_000 and agent["head_dim"] >= 32


def test_make_tiny_models_is_idempotent_and_deterministic(
    tiny_models_dir: Path, tmp_path: Path
) -> None:
    from mars2.models.tiny import make_tiny_models

    marker = tiny_models_dir / "tiny_qwen3" / "mars2_tiny.json"
    stamp = marker.stat().st_mtime_ns
    make_tiny_models(tiny_models_dir)
    assert marker.stat().st_mtime_ns == stamp  # skipped: already present
    fresh = make_tiny_models(tmp_path)
    a = (tiny_models_dir / "tiny_llama" / "tokenizer.json").read_text()
    b = (fresh["tiny_llama"] / "tokenizer.json").read_text()
    assert a == b


def test_missing_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_policy(ModelSpec(path=str(tmp_path / "nowhere")))


def test_missing_chat_template_is_a_clear_error(tiny_models_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_models_dir / "tiny_qwen3"))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="chat template"):
        load_tokenizer(str(tmp_path))


def test_quantization_needs_a_gpu(tiny_models_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(ModelLoadError, match="CUDA"):
        load_policy(ModelSpec(path=str(tiny_models_dir / "tiny_qwen3"), quantization="4bit"))


def test_random_init_builds_from_config_json_alone(tiny_models_dir: Path, tmp_path: Path) -> None:
    """`random_init` (memory calibration): the shape of config.json, random weights, no weight
    file; gradient checkpointing and LoRA applied as for a loaded model."""
    import torch

    config = json.loads((tiny_models_dir / "tiny_qwen3" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="cannot load a causal LM"):
        load_policy(ModelSpec(path=str(tmp_path)))  # no weights: only random_init builds it
    model = load_policy(ModelSpec(path=str(tmp_path), dtype="bfloat16", random_init=True,
                                  gradient_checkpointing=True, lora=LoraSpec(r=4)))  # fmt: skip
    assert model.config.hidden_size == config["hidden_size"]
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    trained = load_policy(ModelSpec(path=str(tiny_models_dir / "tiny_qwen3")))
    assert sum(p.numel() for p in model.base_model.model.parameters() if not p.requires_grad) == (
        sum(p.numel() for p in trained.parameters())
    )
    with pytest.raises(ValueError, match="random_init"):
        ModelSpec(path=str(tmp_path), random_init=True, quantization="4bit")
