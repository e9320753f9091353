"""A generator on transformers' `generate`: runs on CPU or GPU, shares the policy's weights (or
holds its own copy, for generation that overlaps the trainer's updates)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from mars2.generation.base import Completion, Messages
from mars2.generation.prompt import encode_prompt, encode_prompt_noting_cut, marked


class TransformersGenerator:
    """Samples with the policy itself (no weight copy), returning token ids and log-probs.

    Given a model other than the policy (`mars2.generation.factory.weights_copy`), it samples from
    that copy, and a sync copies the policy's weights in between two generation batches (a lock
    keeps a batch from seeing half-copied weights): then it may generate while the trainer
    updates the policy (`overlaps_updates`). Log-probs are those of the sampling distribution at `temperature` (before top-p), the same
    quantity the trainer recomputes, so on-policy importance ratios start at exactly 1.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch_size: int = 32,
        max_prompt_tokens: int | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError("temperature must be > 0 for sampling")
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.weights_version = 0
        self._lock = threading.Lock()
        self._shares_policy: bool | None = None

    @property
    def overlaps_updates(self) -> bool:
        """True on its own copy of the weights: the policy's updates never touch them."""
        return self._shares_policy is False

    def sync_weights(self, policy: Any) -> None:
        """Use the newest weights. Shared with the policy: nothing to copy, only the version moves."""
        self._shares_policy = policy is self.model
        if policy is not self.model:
            with self._lock, torch.no_grad():
                self.model.load_state_dict(policy.state_dict())
        self.weights_version += 1

    def encode_prompt(self, chat: Messages) -> list[int]:
        return encode_prompt(self.tokenizer, chat, self.max_prompt_tokens)

    @torch.no_grad()
    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(chats), self.batch_size):
            encoded = [
                encode_prompt_noting_cut(self.tokenizer, c, self.max_prompt_tokens)
                for c in chats[start : start + self.batch_size]
            ]
            with self._lock:
                done = self._generate_batch([ids for ids, _ in encoded])
            out.extend(marked(done, [cut for _, cut in encoded]))
        return out

    def _generate_batch(self, prompts: list[list[int]]) -> list[Completion]:
        model = self.model
        device = next(model.parameters()).device
        pad = self.tokenizer.pad_token_id
        eos_ids = {self.tokenizer.eos_token_id}
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding, so every row continues at the end
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        was_training = model.training
        model.eval()
        try:
            result = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                do_sample=True,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=0,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=pad,
                eos_token_id=list(eos_ids),
                return_dict_in_generate=True,
                output_logits=True,
            )
        finally:
            model.train(was_training)
        generated = result.sequences[:, width:].cpu()
        logits = torch.stack(result.logits, dim=1).float().cpu() / self.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        completions = []
        for row, prompt in enumerate(prompts):
            tokens = generated[row].tolist()
            ended = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
            keep = (
                len(tokens) if ended is None else ended + 1
            )  # keep the eos: the policy chose to stop
            tokens = tokens[:keep]
            text_tokens = tokens[:-1] if ended is not None else tokens
            completions.append(
                Completion(
                    text=self.tokenizer.decode(text_tokens, skip_special_tokens=True),
                    prompt_token_ids=prompt,
                    token_ids=tokens,
                    logprobs=logprobs[row, :keep].tolist(),
                    truncated=ended is None,
                )
            )
        return completions


class ScriptedGenerator:
    """Replays given answers as if sampled, tokenized with an agent's tokenizer (no log-probs).

    For tests that need controlled rewards and for supervised warm starts: `answers(chat)` returns
    the text to emit for each prompt. Prompts are encoded as every generator encodes them (cut to
    `max_prompt_tokens` where set, and marked when cut).
    """

    def __init__(self, tokenizer: Any, answers: Any, max_prompt_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.answers = answers
        self.max_prompt_tokens = max_prompt_tokens
        self.weights_version = 0
        self.overlaps_updates = True  # no weights: nothing an update could change under it

    def sync_weights(self, policy: Any) -> None:
        self.weights_version += 1

    def generate(self, chats: Sequence[Messages]) -> list[Completion]:
        out = []
        for chat in chats:
            text = self.answers(chat)
            ids, cut = encode_prompt_noting_cut(self.tokenizer, chat, self.max_prompt_tokens)
            tokens = [
                *self.tokenizer.encode(text, add_special_tokens=False),
                self.tokenizer.eos_token_id,
            ]
            out.append(Completion(text=text, prompt_token_ids=ids, token_ids=tokens,
                                  logprobs=None, prompt_cut=cut))  # fmt: skip
        return out
