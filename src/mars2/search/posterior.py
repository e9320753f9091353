"""Posteriors for Thompson sampling: Beta for rewards in [0, 1], Normal-Inverse-Gamma otherwise."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

PosteriorKind = Literal["beta", "nig"]


@dataclass
class RewardStats:
    """Sufficient statistics of a set of rewards, plus pending (virtual, counted as 0) results."""

    count: float = 0.0
    total: float = 0.0
    total_sq: float = 0.0
    pending: int = 0
    outside: int = 0  # rewards outside [0, 1] among them (a Beta posterior refuses any)

    def add(self, reward: float, weight: float = 1.0) -> None:
        self.count += weight
        self.total += weight * reward
        self.total_sq += weight * reward * reward
        if not 0.0 <= reward <= 1.0:
            self.outside += 1

    def plus(self, other: RewardStats) -> RewardStats:
        """Both sets of rewards, pending results included."""
        return RewardStats(
            self.count + other.count,
            self.total + other.total,
            self.total_sq + other.total_sq,
            self.pending + other.pending,
            self.outside + other.outside,
        )

    def as_observations(self, count: float) -> RewardStats:
        """The same mean and spread worth `count` observations (none when there are no rewards)."""
        if self.count <= 0 or count <= 0:
            return RewardStats()
        scale = count / self.count
        return RewardStats(count, self.total * scale, self.total_sq * scale, 0, self.outside)


@dataclass(frozen=True)
class Prior:
    """Prior hyper-parameters. Beta: alpha, beta. NIG: mu0, kappa0, alpha0 (as `alpha`), beta0 (as `beta`)."""

    kind: PosteriorKind = "beta"
    alpha: float = 0.5
    beta: float = 0.5
    mu0: float = 0.0
    kappa0: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("beta", "nig"):
            raise ValueError(f"unknown posterior {self.kind!r}: use 'beta' or 'nig'")
        if self.alpha <= 0 or self.beta <= 0 or self.kappa0 <= 0:
            raise ValueError("prior parameters must be positive")


def _refuse(stats: RewardStats) -> ValueError:
    return ValueError(
        f"a Beta posterior holds rewards in [0, 1] only, but {stats.outside} of these "
        f"{stats.count:.6g} rewards lie outside it: search statistics must see the raw grade "
        "reward in [0, 1] (binary or pass rate), never a shaped or length-penalised one. For "
        "rewards outside [0, 1] use a Normal-Inverse-Gamma posterior "
        "(search.config.policy.prior.kind=nig)."
    )


def beta_params(stats: RewardStats, prior: Prior) -> tuple[float, float]:
    """Beta(α, β) after rewards r: α += r, β += 1 - r; pending results count as r = 0.

    Rewards outside [0, 1] are refused: they would make α or β meaningless (or negative).
    """
    if stats.outside:
        raise _refuse(stats)
    alpha = prior.alpha + stats.total
    beta = prior.beta + (stats.count - stats.total) + stats.pending
    return alpha, beta


def nig_params(stats: RewardStats, prior: Prior) -> tuple[float, float, float, float]:
    """Normal-Inverse-Gamma (μ, κ, α, β) after the rewards; pending results count as r = 0."""
    n = stats.count + stats.pending
    if n == 0:
        return prior.mu0, prior.kappa0, prior.alpha, prior.beta
    mean = stats.total / n
    sq_dev = max(0.0, stats.total_sq - n * mean * mean)
    kappa = prior.kappa0 + n
    mu = (prior.kappa0 * prior.mu0 + n * mean) / kappa
    alpha = prior.alpha + n / 2
    beta = prior.beta + 0.5 * sq_dev + prior.kappa0 * n * (mean - prior.mu0) ** 2 / (2 * kappa)
    return mu, kappa, alpha, beta


def thompson_draw(stats: RewardStats, prior: Prior, rng: np.random.Generator) -> float:
    """One sample of the mean reward from the posterior."""
    if prior.kind == "beta":
        a, b = beta_params(stats, prior)
        return float(rng.beta(a, b))
    mu, kappa, alpha, beta = nig_params(stats, prior)
    variance = beta / rng.gamma(alpha)  # σ² ~ InvGamma(α, β)
    return float(rng.normal(mu, math.sqrt(variance / kappa)))


def thompson_draws(stats: list[RewardStats], prior: Prior, rng: np.random.Generator) -> list[float]:
    """One posterior sample of the mean reward for each of `stats` (scalar draws: with a handful
    of arms numpy's per-call overhead makes array draws slower)."""
    if prior.kind == "beta":
        for s in stats:
            if s.outside:
                raise _refuse(s)
        a0, b0 = prior.alpha, prior.beta
        return [rng.beta(a0 + s.total, b0 + s.count - s.total + s.pending) for s in stats]
    return [thompson_draw(s, prior, rng) for s in stats]


def argmax(values: list[float]) -> int:
    """Index of the largest value (the first one on ties)."""
    return max(range(len(values)), key=values.__getitem__)
