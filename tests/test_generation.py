"""Generators: log-probs that match the trainer's, scripted answers, LoRA weight merging for vLLM."""

from __future__ import annotations

from pathlib import Path

import torch

from mars2.generation.transformers_backend import ScriptedGenerator, TransformersGenerator
from mars2.generation.vllm_backend import merged_weights
from mars2.models.loading import LoraSpec, ModelSpec, load_policy, load_tokenizer
from mars2.training.losses import token_logprobs

CHAT = [{"role": "user", "content": "Write a program."}]


def test_rollout_logprobs_equal_the_trainers(tiny_models_dir: Path) -> None:
    path = str(tiny_models_dir / "tiny_llama")
    model, tokenizer = load_policy(ModelSpec(path)), load_tokenizer(path)
    generator = TransformersGenerator(model, tokenizer, max_new_tokens=12, temperature=0.7)
    for completion in generator.generate([CHAT, CHAT[:1] * 1]):
        ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
        start = len(completion.prompt_token_ids) - 1
        with torch.no_grad():
            logits = model(ids).logits[:, start:-1]
        recomputed = token_logprobs(logits, ids[:, start + 1 :], temperature=0.7)[0]
        assert completion.logprobs is not None and len(completion.logprobs) == len(
            completion.token_ids
        )
        torch.testing.assert_close(
            recomputed, torch.tensor(completion.logprobs), atol=1e-4, rtol=1e-4
        )
    assert all(not c.truncated or len(c.token_ids) == 12 for c in generator.generate([CHAT] * 3))


def test_scripted_generator_tokenizes_with_the_agents_tokenizer(tiny_models_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_models_dir / "tiny_qwen3"))
    (completion,) = ScriptedGenerator(tokenizer, lambda chat: "print(1)").generate([CHAT])
    assert completion.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(completion.token_ids[:-1]) == "print(1)"


def test_lora_weights_merge_without_destroying_the_adapter(tiny_models_dir: Path) -> None:
    spec = ModelSpec(
        str(tiny_models_dir / "tiny_qwen3"),
        lora=LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    )
    policy = load_policy(spec)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)  # a non-zero adapter
    base = load_policy(ModelSpec(spec.path))
    weights = dict(merged_weights(policy))
    assert set(weights) == set(base.state_dict())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[q], base.state_dict()[q])  # the adapter is merged in
    assert any("lora_A" in n for n, _ in policy.named_parameters())  # and still there
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        with_adapter = policy(ids).logits
        with policy.disable_adapter():
            without = policy(ids).logits
    assert not torch.allclose(with_adapter, without)
