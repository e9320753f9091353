"""Confidence intervals over seeds: Student-t intervals of a mean and of paired differences.

Plain Python (no scipy): the t quantile comes from the exact closed-form t distribution function
for integer degrees of freedom (Abramowitz & Stegun 26.7.3-4), inverted by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (integer >= 1) degrees of freedom."""
    if df < 1:
        raise ValueError("degrees of freedom must be >= 1")
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2 == 1:
        series, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= cos2 * (2 * k) / (2 * k + 1)
        return 2 / math.pi * (theta + math.sin(theta) * series)
    series, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):
        series += term
        term *= cos2 * (2 * k - 1) / (2 * k)
    return math.sin(theta) * series


def t_quantile(level: float, df: int) -> float:
    """The t such that P(|T| <= t) = `level` (e.g. 0.95 -> 2.776 for df = 4)."""
    if not 0.0 < level < 1.0:
        raise ValueError("level must be in (0, 1)")
    lo, hi = 0.0, 1.0
    while t_two_sided_mass(hi, df) < level:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_two_sided_mass(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """Mean of `n` values and its two-sided confidence interval (None when n < 2)."""

    mean: float
    low: float | None
    high: float | None
    n: int

    @property
    def bounds(self) -> list[float | None]:
        return [self.low, self.high]

    @property
    def excludes_zero(self) -> bool:
        """Both ends on the same side of 0 (False when there is no interval)."""
        if self.low is None or self.high is None:
            return False
        return self.low > 0 or self.high < 0


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Student-t interval of the mean: mean ± t(level, n-1) · sd / sqrt(n), sd with n - 1."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to summarise")
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, None, None, 1)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_interval(
    first: Mapping[int, float], second: Mapping[int, float], level: float = 0.95
) -> Interval:
    """Interval of the mean per-seed difference first[s] - second[s]; both must have the same seeds."""
    if set(first) != set(second):
        raise ValueError(f"paired values need the same seeds: {sorted(first)} vs {sorted(second)}")
    return mean_interval([first[s] - second[s] for s in sorted(first)], level)


def gain(curve: Mapping[int, float], last: int = 3) -> float:
    """Mean of the last `last` evaluations minus the one at step 0."""
    if 0 not in curve:
        raise ValueError("the curve has no step-0 evaluation")
    steps = sorted(curve)
    if len(steps) < last + 1:
        raise ValueError(f"a gain over the last {last} evaluations needs {last + 1} evaluations")
    return math.fsum(curve[s] for s in steps[-last:]) / last - curve[0]
