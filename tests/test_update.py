"""One agent's update on a rollout: micro-batch invariance, several steps per rollout, ranks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from mars2.generation.base import Completion
from mars2.models.loading import ModelSpec
from mars2.rewards.routing import Sample
from mars2.search.tree import Node
from mars2.training.agent_module import AgentModule, OptimConfig, optimise_agent
from mars2.training.batching import micro_batches, split_rows
from mars2.training.losses import LossConfig

VARIANTS = ["grpo", "dr_grpo", "dapo", "gspo"]
LENGTHS = [(3, 9), (5, 2), (2, 6), (4, 4), (3, 1)]  # (prompt, completion) tokens: uneven on purpose
ADVANTAGES = [1.2, -0.8, 0.5, -1.5, 0.9]


@pytest.fixture(scope="module")
def agent(tiny_models_dir: Path) -> AgentModule:
    spec = ModelSpec(path=str(tiny_models_dir / "tiny_qwen3"), dtype="float32")
    return AgentModule("tiny_qwen3", spec, micro_batch_size=8)


def _samples(vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for index, ((p, c), adv) in enumerate(zip(LENGTHS, ADVANTAGES, strict=True)):
        ids = torch.randint(3, vocab, (p + c,), generator=gen).tolist()
        completion = Completion(text="", prompt_token_ids=ids[:p], token_ids=ids[p:])
        node = Node(index + 1, 0, 1, agent="tiny_qwen3", completion=completion)
        out.append(Sample(node, 0, 0.0, adv))
    return out


class _Capture:
    """An optimizer that records the gradient of each step instead of stepping (a probe)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.grads: list[list[torch.Tensor]] = []

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:
            p.grad = None if set_to_none else torch.zeros_like(p)

    def step(self) -> None:
        self.grads.append([p.grad.detach().clone() for p in self.params if p.grad is not None])


class _NoSchedule:
    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [0.0]


def _step_gradient(agent: AgentModule, samples: list[Sample], size: int, **kw: Any) -> list[Any]:
    params = [p for p in agent.policy.parameters() if p.requires_grad]
    probe = _Capture(params)
    batches = micro_batches(samples, size, agent.tokenizer.pad_token_id)
    optimise_agent(agent, probe, _NoSchedule(), batches, lambda loss: loss.backward(), **kw)
    return probe.grads


@pytest.mark.parametrize("variant", VARIANTS)
def test_micro_batch_size_does_not_change_the_gradient(agent: AgentModule, variant: str) -> None:
    agent.loss_config = LossConfig(variant=variant, eps_high=0.28, max_tokens=16)  # type: ignore[arg-type]
    agent.optim_config = OptimConfig(grad_clip=None)
    samples = _samples(agent.policy.config.vocab_size)
    whole = _step_gradient(agent, samples, len(samples), num_samples=len(samples))
    single = _step_gradient(agent, samples, 1, num_samples=len(samples))
    assert len(whole) == len(single) == 1
    assert any(g.abs().sum() > 0 for g in whole[0])
    for a, b in zip(whole[0], single[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("variant", ["dapo", "gspo"])
def test_several_updates_per_rollout_do_not_depend_on_micro_batch_size(
    agent: AgentModule, variant: str
) -> None:
    """Two epochs of two mini-batches: same weights for micro-batch 1 and 5.

    SGD, whose step is linear in the gradient, so float rounding stays at rounding size; Adam
    divides near-zero gradients by near-zero moments and turns that rounding into a few percent
    of a step on a handful of weights (whichever mini-batches the shuffle draws)."""
    agent.loss_config = LossConfig(variant=variant, eps_high=0.28, beta=0.0)  # type: ignore[arg-type]
    agent.optim_config = OptimConfig(ppo_epochs=2, mini_batches=2, grad_clip=None)
    start = copy.deepcopy(agent.policy.state_dict())
    samples = _samples(agent.policy.config.vocab_size)
    finals, metrics = [], []
    for size in (len(samples), 1):
        agent.policy.load_state_dict(start)
        optimizer = torch.optim.SGD(agent.policy.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        pad = agent.tokenizer.pad_token_id
        batches = micro_batches(samples, size, pad, mini_batches=2, seed=(0, 1))
        metrics.append(
            optimise_agent(agent, optimizer, scheduler, batches, lambda loss: loss.backward())
        )
        finals.append(copy.deepcopy(agent.policy.state_dict()))
    agent.policy.load_state_dict(start)
    assert metrics[0]["updates"] == metrics[1]["updates"] == 4
    # lr 0.1 moves the policy: later updates see ratios away from 1 and clip some tokens
    assert metrics[0]["clip_fraction"] > 0
    assert abs(metrics[0]["ratio"] - 1.0) > 1e-4
    moved = max(float((finals[0][k] - v).abs().max()) for k, v in start.items())
    assert moved > 1e-2
    for key, value in finals[0].items():
        torch.testing.assert_close(finals[1][key], value, rtol=1e-4, atol=1e-6)


def test_ranks_that_sum_their_gradients_match_one_process(agent: AgentModule) -> None:
    """Two ranks, each normalising by the global sizes, then summing (what the all-reduce does)."""
    agent.loss_config = LossConfig(variant="dapo", eps_high=0.28)
    agent.optim_config = OptimConfig(grad_clip=None)
    samples = _samples(agent.policy.config.vocab_size)
    whole = _step_gradient(agent, samples, 2)[0]
    shards = [samples[:2], samples[2:]]
    pad = agent.tokenizer.pad_token_id
    local = [
        [len(s), sum(int(b["completion_mask"].sum()) for b in micro_batches(s, 8, pad))]
        for s in shards
    ]
    total = [sum(col) for col in zip(*local, strict=True)]
    summed = [torch.zeros_like(g) for g in whole]
    for shard in shards:
        grads = _step_gradient(agent, shard, 2, global_sizes=lambda _: total)[0]
        summed = [a + b for a, b in zip(summed, grads, strict=True)]
    for a, b in zip(summed, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_split_rows_keeps_every_row_once_in_order() -> None:
    batches = [
        {"advantages": torch.arange(3.0), "x": torch.arange(6.0).view(3, 2)},
        {"advantages": torch.arange(3.0, 5.0), "x": torch.arange(6.0, 10.0).view(2, 2)},
    ]
    parts = split_rows(batches, 2)
    rows = [[float(v) for b in part for v in b["advantages"]] for part in parts]
    assert rows == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    assert torch.equal(parts[1][0]["x"], torch.tensor([[4.0, 5.0]]))
    thin = split_rows(batches[:1], 5)  # fewer rows than parts: some parts are empty
    assert [] in thin and sum(len(b["advantages"]) for p in thin for b in p) == 3
    with pytest.raises(ValueError, match="parts"):
        split_rows(batches, 0)


def test_bad_update_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="ppo_epochs"):
        OptimConfig(ppo_epochs=0)


class _Recorder(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


@pytest.mark.slow
def test_tiny_pair_with_two_epochs_clips_some_tokens(tmp_path: Path, tiny_models_dir: Path) -> None:
    """tiny_pair with ppo_epochs=2: the second pass sees ratios off 1, and clipping acts."""
    from mars2.training.run import build_run
    from tests.test_training import compose_run, script_all

    cfg = compose_run(
        tmp_path,
        tiny_models_dir,
        "steps=2",
        "ppo_epochs=2",
        "logger=none",
        "callbacks.checkpoint=null",
    )
    module, datamodule, trainer, sandbox = build_run(cfg)
    recorder = _Recorder()
    trainer.callbacks.append(recorder)
    script_all(module)
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        sandbox.close()
    assert len(recorder.steps) == 2
    updates = [s[k] for s in recorder.steps for k in s if k.endswith("/updates")]
    assert updates and set(updates) == {2.0}
    clip = [s[k] for s in recorder.steps for k in s if k.endswith("/clip_fraction")]
    assert max(clip) > 0


# -- two gloo ranks against one process ---------------------------------------------------------


class _TinyLM(torch.nn.Module):
    """A two-layer stand-in policy (the real models are too slow to load in two processes)."""

    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.head(torch.tanh(self.embed(input_ids))))


class _LiteAgent:
    """AgentModule's own loss code around `_TinyLM`."""

    off_policy_samples = False  # AgentModule.__init__ sets it; the callback raises it in flight
    compute_loss = AgentModule.compute_loss
    loss_mask = AgentModule.loss_mask
    freeze_rollout = AgentModule.freeze_rollout
    reference_logprobs = AgentModule.reference_logprobs
    next_token_logprobs = AgentModule.next_token_logprobs

    def __init__(self, variant: str) -> None:
        from mars2.training.agent_module import GenerationConfig

        self.policy = _TinyLM()
        self.loss_config = LossConfig(variant=variant, eps_high=0.28)  # type: ignore[arg-type]
        self.optim_config = OptimConfig(grad_clip=None)
        self.generation_config = GenerationConfig()


def _lite_gradients(variant: str, samples: list[Sample], **kw: Any) -> list[torch.Tensor]:
    agent = _LiteAgent(variant)
    probe = _Capture(list(agent.policy.parameters()))
    batches = micro_batches(samples, 1, 0)
    optimise_agent(agent, probe, _NoSchedule(), batches, lambda loss: loss.backward(), **kw)  # type: ignore[arg-type]
    return probe.grads[0]


def _rank_main(rank: int, out: str) -> None:
    from mars2.training.distributed import global_counts, sum_gradients

    samples = _samples(40)
    shard = samples[:1] if rank == 0 else samples[1:]  # uneven on purpose
    grads = {
        variant: _lite_gradients(
            variant,
            shard,
            sync_gradients=lambda a: sum_gradients(a.policy),
            global_sizes=lambda s: global_counts(s, torch.device("cpu")),
        )
        for variant in VARIANTS
    }
    if rank == 0:
        torch.save(grads, out)


@pytest.mark.slow
def test_two_gloo_ranks_give_the_one_process_gradient(tmp_path: Path) -> None:
    from tests.ranks import on_two_gloo_ranks

    out = str(tmp_path / "grads.pt")
    on_two_gloo_ranks(_rank_main, out)
    distributed = torch.load(out)
    for variant in VARIANTS:
        alone = _lite_gradients(variant, _samples(40))
        for a, b in zip(distributed[variant], alone, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# -- the LR schedule counts team steps (rollouts), whatever each rollout's number of updates -----


class _ScheduledAgent(_LiteAgent):
    build_optimizer = AgentModule.build_optimizer

    def __init__(self, optim: OptimConfig) -> None:
        super().__init__("dapo")
        self.optim_config = optim

    def _optimizer_stepped(self, *args: Any) -> None:
        pass


def _cosine(step: int, total: int, warmup: int) -> float:
    import math

    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.parametrize(("ppo_epochs", "mini_batches"), [(1, 1), (1, 2), (2, 1), (2, 3), (3, 2)])
def test_lr_schedule_lasts_the_whole_run(ppo_epochs: int, mini_batches: int) -> None:
    """Cosine over `total_steps` team steps: every rollout of the run trains at the LR its team step
    gives, the LR is never 0 before the end and reaches its final value (0) after the last step;
    a run resumed midway (optimizer and scheduler state reloaded) continues the same sequence."""
    steps, warmup, lr = 6, 1, 1e-3
    optim = OptimConfig(
        lr=lr, schedule="cosine", warmup_steps=warmup, total_steps=steps, grad_clip=None,
        ppo_epochs=ppo_epochs, mini_batches=mini_batches,
    )  # fmt: skip
    samples = _samples(40)
    expected = [lr * _cosine(t, steps, warmup) for t in range(steps)]

    def run(start: int, stop: int, state: Any = None) -> tuple[list[float], Any, float]:
        agent = _ScheduledAgent(optim)
        optimizer, scheduler = agent.build_optimizer()
        if state is not None:
            optimizer.load_state_dict(state[0])
            scheduler.load_state_dict(state[1])
        used = []
        for _ in range(start, stop):
            batches = micro_batches(samples, 2, 0, mini_batches=mini_batches, seed=(0,))
            metrics = optimise_agent(agent, optimizer, scheduler, batches, lambda x: x.backward())  # type: ignore[arg-type]
            assert metrics["updates"] == ppo_epochs * mini_batches
            used.append(metrics["lr"])
        state = (optimizer.state_dict(), scheduler.state_dict())
        return used, state, float(scheduler.get_last_lr()[0])

    whole, _, final = run(0, steps)
    assert whole == pytest.approx(expected)
    assert min(whole) > 0 and final == pytest.approx(0.0, abs=1e-12)
    first, state, _ = run(0, 2)
    rest, _, resumed_final = run(2, steps, state)
    assert first + rest == pytest.approx(expected) and resumed_final == pytest.approx(
        0.0, abs=1e-12
    )


# -- mini-batches: a seeded shuffle, then sorted inside each for padding ------------------------


def _many_samples(count: int = 12) -> list[Sample]:
    out = []
    for index in range(count):
        completion = Completion(text="", prompt_token_ids=[3, 4], token_ids=[5] * (index + 1))
        node = Node(index + 1, 0, 1, agent="a", completion=completion)
        out.append(Sample(node, 0, 0.0, float(index)))  # advantage = identity, length = index + 1
    return out


def _parts(samples: list[Sample], seed: tuple[int, ...], parts: int = 2) -> list[list[int]]:
    batches = micro_batches(samples, 2, 0, mini_batches=parts, seed=seed)
    split = split_rows(batches, parts)
    for part in split:  # each micro-batch lies wholly inside one mini-batch
        assert all(any(b is m for m in batches) for b in part)
    return [[int(v) for b in part for v in b["advantages"]] for part in split]


def test_mini_batches_are_shuffled_then_sorted_for_padding() -> None:
    samples = _many_samples()
    parts = _parts(samples, (7, 0, 0))
    assert sorted(parts[0] + parts[1]) == list(range(12)) and [len(p) for p in parts] == [6, 6]
    for part in parts:  # longest first inside a mini-batch, to keep padding low
        assert part == sorted(part, reverse=True)
    assert _parts(samples, (7, 0, 0)) == parts  # reproducible (and so resumable)
    longest_first = 0
    for seed in range(200):
        longest_first += 11 in _parts(samples, (seed, 3, 0))[0]
    assert 60 < longest_first < 140  # the longest half is no longer always the first update
