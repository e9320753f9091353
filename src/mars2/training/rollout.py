"""One training step's data: pick problems, grow their trees, shape rewards, route samples."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mars2.data.problem import Problem
from mars2.rewards.routing import AdvantageConfig, LengthTerm, Sample, route_samples
from mars2.search.core import GraderLike
from mars2.search.policy import AgentStatistics
from mars2.search.runner import TreeSearch
from mars2.search.services import SANDBOX
from mars2.search.tree import SearchTree


class TreeBundle:
    """The step's trees, opaque to Lightning's batch transfer (it does not recurse into it)."""

    def __init__(self, trees: list[SearchTree]) -> None:
        self.trees = trees


@dataclass
class StepData:
    """Everything one step produced before tokenisation.

    `step` is the step's 0-based index (it seeds the step and picks its problems); `number`, one
    more, is how the step is shown and written everywhere (docs/running.md, "Step numbers")."""

    step: int
    trees: list[SearchTree]
    samples: dict[str, list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def number(self) -> int:
        """The step's number as shown and written: 1 for the first (tree files, node labels,
        checkpoints, logged metrics and progress lines all agree)."""
        return self.step + 1

    def share(self, part: int, parts: int) -> StepData:
        """Share `part` of `parts`: every `parts`-th sample of each agent; the trees stay with
        share 0 (they are logged and saved once), the metrics with every share."""
        samples = {name: mine[part::parts] for name, mine in self.samples.items()}
        return StepData(self.step, self.trees if part == 0 else [], samples, dict(self.metrics))


class ProblemSchedule:
    """Which problems each step sees: a seeded permutation per epoch, sliced by step and rank.

    A function of (seed, step, rank) alone, so a resumed run sees exactly the batches it would
    have seen.
    """

    def __init__(self, problems: Sequence[Problem], per_step: int, seed: int) -> None:
        if not problems:
            raise ValueError("no training problems")
        if per_step < 1:
            raise ValueError("problems_per_step must be >= 1")
        self.problems = list(problems)
        self.per_step = per_step
        self.seed = seed

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))

    def for_step(self, step: int, rank: int = 0, world: int = 1) -> list[Problem]:
        size = self.per_step * world
        start = step * size + rank * self.per_step
        picked = []
        for offset in range(self.per_step):
            flat = start + offset
            epoch, index = divmod(flat, len(self.problems))
            picked.append(self.problems[int(self._order(epoch)[index])])
        return picked


class RolloutEngine:
    """Grows the step's trees with the agents' generators and turns them into routed samples."""

    def __init__(
        self,
        schedule: ProblemSchedule,
        search: TreeSearch,
        grader: GraderLike,
        advantages: AdvantageConfig | None = None,
        agent_statistics: AgentStatistics | None = None,
    ) -> None:
        self.schedule = schedule
        self.search = search
        self.grader = grader
        self.advantages = advantages or AdvantageConfig()
        self.agent_statistics = agent_statistics
        if search.config.mode == "independent" and self.advantages.gamma != 0:
            raise ValueError(
                f"search.config.mode=independent with advantage.gamma={self.advantages.gamma}: "
                "independent samples form no tree, so tree-consistent shaping only rescales every "
                "advantage (by 1+γ+γ/(G−1), a hidden learning-rate change without std scaling). "
                "Vanilla GRPO uses advantage.gamma=0 (search=grpo sets it)."
            )

    def run(
        self,
        step: int,
        generators: Mapping[str, Any],
        rank: int = 0,
        world: int = 1,
        overlong: Mapping[str, LengthTerm] | None = None,
        frozen: Collection[str] = (),
    ) -> StepData:
        """Grow, score and route the step's trees.

        `frozen` names the members that are never trained: their nodes are in the trees, the
        shaping and the advantage groups like anyone's, and their samples count in no
        ``trained_samples``.

        `overlong[agent]`, a function of the completion's length in tokens (e.g.
        `mars2.rewards.overlong.OverlongPenalty`), adds a reward term to that agent's samples after
        shaping (see `mars2.rewards.routing.tree_samples`); the trees keep the raw grade rewards,
        which are all the search statistics ever see.
        """
        problems = self.schedule.for_step(step, rank, world)
        seed = [self.schedule.seed, step, rank]
        torch.manual_seed(
            int(np.random.default_rng(seed).integers(2**31))
        )  # sampling in generate()
        began = time.perf_counter()
        trees = self.search.grow(  # nodes carry the step's number (StepData.number)
            problems, generators, self.grader, np.random.default_rng(seed), step=step + 1
        )
        elapsed = time.perf_counter() - began
        samples = route_samples(trees, generators.keys(), self.advantages, overlong)
        return StepData(step, trees, samples, self._metrics(trees, samples, elapsed, frozen))

    def run_in_group(
        self,
        step: int,
        generators: Mapping[str, Any],
        group: Any,
        overlong: Mapping[str, Any] | None = None,
        frozen: Collection[str] = (),
    ) -> StepData:
        """One step for a group of ranks sharing tensor-parallel engines (an `EngineGroup`).

        The group grows its slice of the step's problems once: its leader runs the search (as
        rank `group.index` of `group.count`) while the other ranks replay its engine calls, then
        every rank trains on its share of the samples. A leader whose search fails releases
        its group and hands it nothing, so the other ranks fail too instead of waiting.
        """
        if not group.is_leader:
            group.serve()
            share = group.scatter(None)
            if share is None:
                raise RuntimeError(
                    f"rank {group.rank}: the leader of its engine group (rank {group.leader}) "
                    f"failed during step {step}'s rollout; its log has the cause"
                )
            return share
        try:
            data = self.run(step, generators, group.index, group.count, overlong=overlong,
                            frozen=frozen)  # fmt: skip
        except BaseException:
            group.release()
            group.scatter([None] * group.size)
            raise
        group.release()
        return group.scatter([data.share(i, group.size) for i in range(group.size)])

    def _metrics(
        self,
        trees: list[SearchTree],
        samples: dict[str, list[Sample]],
        elapsed: float,
        frozen: Collection[str] = (),
    ) -> dict[str, float]:
        nodes = [n for t in trees for n in t.answers()]
        total = max(1, len(nodes))
        metrics = {
            "reward": float(np.mean([n.reward for n in nodes])) if nodes else 0.0,
            "solve_rate": float(np.mean([t.solved for t in trees])) if trees else 0.0,
            "nodes": float(len(nodes)),
            "rollout_seconds": elapsed,
            "generation_seconds": self.search.timings.generation,
            "grading_seconds": self.search.timings.grading,
            "search_bookkeeping_seconds": self.search.timings.bookkeeping,
            "trained_samples": float(sum(len(v) for k, v in samples.items() if k not in frozen)),
            # Answers our infrastructure failed to grade (worker lost, sandbox unavailable, host
            # overloaded): left out of the rewards (mars2.rewards.routing.graded_only), counted.
            "infra_errors": float(sum(n.grade.infra_error for n in nodes)),
            "truncated_share": float(np.mean([n.truncated for n in nodes])) if nodes else 0.0,
            # Prompts cut to fit generation.max_prompt_tokens (a refinement's previous code):
            # counted, so that a cap too small for the data is never silent.
            "prompts_cut": float(sum(n.completion.prompt_cut for n in nodes)),
        }
        metrics.update(service_usage(self.search.timings.busy, self.search.timings.span, samples))
        tokens = sum(len(n.completion.token_ids) for n in nodes)
        metrics["generated_tokens_per_second"] = tokens / max(self.search.timings.generation, 1e-9)
        for name in samples:
            mine = [n for n in nodes if n.agent == name]
            metrics[f"{name}/expansion_share"] = len(mine) / total
            metrics[f"{name}/reward_mean"] = (
                float(np.mean([n.reward for n in mine])) if mine else 0.0
            )
            metrics[f"{name}/solve_rate"] = (
                float(np.mean([n.private_passed for n in mine])) if mine else 0.0
            )
            metrics[f"{name}/prompts_cut"] = float(sum(n.completion.prompt_cut for n in mine))
            terms = [s.length_term for s in samples[name]]
            metrics[f"{name}/length_term_mean"] = float(np.mean(terms)) if terms else 0.0
        return metrics


def service_usage(
    busy: Mapping[str, float], span: float, agents: Iterable[str]
) -> dict[str, float]:
    """Busy/idle seconds and busy fraction of each generator and the sandbox over the rollout.

    Keys: ``<agent>/generator_busy{,_seconds}``, ``<agent>/generator_idle_seconds``,
    ``sandbox_busy{,_seconds}``, ``sandbox_idle_seconds`` and ``generator_busy`` (the agents' mean).
    """
    span = max(span, 1e-9)
    metrics: dict[str, float] = {}
    fractions = []
    for who in [*agents, SANDBOX]:
        seconds = float(busy.get(who, 0.0))
        prefix = "sandbox" if who == SANDBOX else f"{who}/generator"
        metrics[f"{prefix}_busy_seconds"] = seconds
        metrics[f"{prefix}_idle_seconds"] = max(0.0, span - seconds)
        metrics[f"{prefix}_busy"] = min(1.0, seconds / span)
        if who != SANDBOX:
            fractions.append(metrics[f"{prefix}_busy"])
    metrics["generator_busy"] = float(np.mean(fractions)) if fractions else 0.0
    return metrics
