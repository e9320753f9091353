"""Exact statistics for paired per-seed differences (pure Python; no scipy at run time).

- paired-t interval (`mars2.eval.intervals`), one-sided t p-values;
- exact sign-flip permutation p over all 2^n sign patterns;
- Holm's step-down adjustment;
- TOST equivalence (two one-sided paired t-tests against a margin);
- the minimum detectable effect of a one-sided paired t-test at a power.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from mars2.eval.intervals import mean_interval, t_quantile, t_two_sided_mass

# Differences this close are ties (sums of floats read from JSON).
TIE = 1e-12


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom."""
    tail = (1 - t_two_sided_mass(abs(t), df)) / 2  # P(T > |t|)
    return tail if t >= 0 else 1 - tail


def t_p(diffs: Sequence[float], direction: str = "greater", null: float = 0.0) -> float | None:
    """One- or two-sided paired t-test p of mean(diffs) against `null`; None with no spread."""
    n = len(diffs)
    if n < 2:
        return None
    mean = math.fsum(diffs) / n
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1))
    if sd == 0:
        return None
    t = (mean - null) / (sd / math.sqrt(n))
    if direction == "greater":
        return t_sf(t, n - 1)
    if direction == "less":
        return t_sf(-t, n - 1)
    return min(1.0, 2 * t_sf(abs(t), n - 1))


def sign_flip_p(diffs: Sequence[float], direction: str = "greater") -> float:
    """Exact permutation p: the share of all 2^n sign patterns of |diffs| whose sum is at least
    as extreme as the observed sum (the observed pattern counts; zeros flip to themselves)."""
    n = len(diffs)
    if n == 0:
        raise ValueError("sign_flip_p needs at least one difference")
    if n > 20:
        raise ValueError(f"sign_flip_p enumerates 2^n patterns: n = {n} is more than 20")
    observed = math.fsum(diffs)
    size = [abs(d) for d in diffs]
    hits = 0
    for signs in itertools.product((1, -1), repeat=n):
        total = math.fsum(s * d for s, d in zip(signs, size, strict=True))
        if direction == "greater":
            hits += total >= observed - TIE
        elif direction == "less":
            hits += total <= observed + TIE
        else:
            hits += abs(total) >= abs(observed) - TIE
    return hits / 2**n


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given), capped at 1."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


def tost_p(diffs: Sequence[float], margin: float) -> float | None:
    """TOST: the larger of the two one-sided paired t p-values for mean > -margin and
    mean < +margin; below alpha reads "equivalent within ±margin". None without spread."""
    lower = t_p(diffs, "greater", -margin)
    upper = t_p(diffs, "less", margin)
    if lower is None or upper is None:
        return None
    return max(lower, upper)


def minimum_detectable_effect(sd: float, n: int, alpha: float, power: float = 0.8) -> float | None:
    """Smallest true mean difference a one-sided paired t-test at `alpha` detects with `power`
    (noncentral-t approximated by the central t quantiles: (t_{1-alpha} + t_{power}) sd/sqrt n)."""
    if n < 2:
        return None
    df = n - 1
    # t_quantile(level, df) is the two-sided quantile: the (1 + level)/2 one-sided one.
    return (t_quantile(1 - 2 * alpha, df) + t_quantile(2 * power - 1, df)) * sd / math.sqrt(n)


def describe(diffs: Sequence[float], direction: str, margin: float, level: float,
             alpha: float, family_size: int) -> dict[str, object]:  # fmt: skip
    """Everything the report states about one comparison (before the family's Holm step)."""
    n = len(diffs)
    interval = mean_interval(list(diffs), level)
    sd = math.sqrt(math.fsum((d - interval.mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else None
    return {
        "n": n,
        "diffs": list(diffs),
        "mean": interval.mean,
        "sd": sd,
        "ci": interval.bounds,
        "t_p": t_p(diffs, direction),
        "sign_flip_p": sign_flip_p(diffs, direction),
        "min_sign_flip_p": 1 / 2**n,
        "tost_p": tost_p(diffs, margin),
        "mde": None if sd is None else minimum_detectable_effect(sd, n, alpha / family_size),
    }
