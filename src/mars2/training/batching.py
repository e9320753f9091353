"""Pack one agent's samples into padded micro-batches of its own tokenizer's ids."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from mars2.rewards.routing import Sample


def _length(sample: Sample) -> int:
    return len(sample.node.completion.prompt_token_ids) + len(sample.node.completion.token_ids)


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion ids with a mask over completion targets.

    ``completion_mask[b, t]`` is 1 where ``input_ids[b, t + 1]`` is a completion token, so it lines
    up with logits[:, :-1]. ``rollout_logprobs`` is zero where a generator gave none
    (``has_rollout_logprobs`` says which rows have them).
    """
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    lengths = [_length(s) for s in samples]
    width = max(lengths)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    completion_mask = torch.zeros((batch, width - 1), dtype=torch.float32)
    rollout = torch.zeros((batch, width - 1), dtype=torch.float32)
    has_rollout = torch.zeros(batch, dtype=torch.bool)
    for row, sample in enumerate(samples):
        answer = sample.node.completion
        if not answer.token_ids:
            raise ValueError(f"sample of node {sample.node_id} has no completion token ids")
        prompt, completion = answer.prompt_token_ids, answer.token_ids
        ids = [*prompt, *completion]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        first = len(prompt) - 1  # logits at position p predict token p + 1
        completion_mask[row, first : first + len(completion)] = 1.0
        if answer.logprobs is not None:
            if len(answer.logprobs) != len(completion):
                raise ValueError(
                    f"node {sample.node_id}: {len(answer.logprobs)} log-probs for {len(completion)} tokens"
                )
            rollout[row, first : first + len(completion)] = torch.tensor(answer.logprobs)
            has_rollout[row] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "truncated": torch.tensor([s.node.truncated for s in samples], dtype=torch.bool),
        "rollout_logprobs": rollout,
        "has_rollout_logprobs": has_rollout,
    }


def part_bounds(rows: int, parts: int) -> list[int]:
    """Where `rows` rows are cut into `parts` near-equal parts: parts + 1 row indices."""
    return [round(rows * k / parts) for k in range(parts + 1)]


def micro_batches(
    samples: Sequence[Sample],
    size: int,
    pad_id: int,
    mini_batches: int = 1,
    seed: Sequence[int] = (0,),
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of at most `size` samples, laid out mini-batch after mini-batch.

    The samples are shuffled by a generator seeded with `seed` (the run's seed, step, rank and
    agent: reproducible, so a resumed run trains on the same mini-batches), cut into
    `mini_batches` near-equal mini-batches, and sorted longest first inside each to keep padding
    low; no micro-batch straddles two mini-batches, so `split_rows(batches, mini_batches)` gives
    them back whole.
    """
    if size < 1:
        raise ValueError("micro-batch size must be >= 1")
    if mini_batches < 1:
        raise ValueError("mini_batches must be >= 1")
    order = np.random.default_rng(list(seed)).permutation(len(samples))
    shuffled = [samples[int(i)] for i in order]
    bounds = part_bounds(len(shuffled), mini_batches)
    out: list[dict[str, torch.Tensor]] = []
    for low, high in itertools.pairwise(bounds):
        part = sorted(shuffled[low:high], key=_length, reverse=True)
        out.extend(collate(part[i : i + size], pad_id) for i in range(0, len(part), size))
    return out


def shuffle_seed(seed: int, step: int, rank: int, agent: str) -> list[int]:
    """The mini-batch shuffle's seed for one agent's samples of one step on one rank."""
    return [seed, step, rank, zlib.crc32(agent.encode())]


def split_rows(
    batches: Sequence[dict[str, torch.Tensor]], parts: int
) -> list[list[dict[str, torch.Tensor]]]:
    """The rows of `batches`, in order, cut into `parts` near-equal mini-batches.

    Micro-batches are sliced where a cut falls inside one, never merged, so none grows. Every
    tensor of a micro-batch has the sample as its first dimension. A part may be empty when there
    are fewer rows than parts.
    """
    if parts < 1:
        raise ValueError("parts must be >= 1")
    if parts == 1:
        return [list(batches)]
    rows = sum(int(b["advantages"].shape[0]) for b in batches)
    bounds = part_bounds(rows, parts)
    out: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(parts)]
    start = 0
    for batch in batches:
        size = int(batch["advantages"].shape[0])
        for k in range(parts):
            low, high = max(bounds[k], start), min(bounds[k + 1], start + size)
            if low >= high:
                continue
            if low == start and high == start + size:
                out[k].append(batch)
            else:
                out[k].append({key: v[low - start : high - start] for key, v in batch.items()})
        start += size
    return out
