"""Confidence intervals over seeds (mars2.eval.intervals) on inputs with known answers."""

from __future__ import annotations

import math

import pytest

from mars2.eval.intervals import gain, mean_interval, paired_interval, t_quantile

# Two-sided 95% Student-t critical values from printed tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2).
TABLE_95 = {1: 12.706, 2: 4.303, 4: 2.776, 9: 2.262, 30: 2.042, 100: 1.984}


@pytest.mark.parametrize(("df", "expected"), sorted(TABLE_95.items()))
def test_t_quantile_matches_printed_tables(df: int, expected: float) -> None:
    assert t_quantile(0.95, df) == pytest.approx(expected, abs=5e-4)


def test_t_quantile_matches_scipy_where_installed() -> None:
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 7, 12, 29, 60):
        for level in (0.8, 0.9, 0.95, 0.99):
            expected = stats.t.ppf(0.5 + level / 2, df)
            assert t_quantile(level, df) == pytest.approx(expected, rel=1e-9)


def test_mean_interval_on_known_values() -> None:
    # mean 3, sd sqrt(2.5), se sqrt(0.5); half width 2.7764451 * 0.7071068 = 1.9632432
    interval = mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert interval.mean == pytest.approx(3.0)
    assert interval.low == pytest.approx(3.0 - 1.9632432, abs=1e-6)
    assert interval.high == pytest.approx(3.0 + 1.9632432, abs=1e-6)
    assert interval.n == 5 and interval.excludes_zero
    assert not mean_interval([-1.0, 1.0, 0.5]).excludes_zero


def test_one_value_has_no_interval_and_none_is_an_error() -> None:
    single = mean_interval([0.4])
    assert single.mean == 0.4 and single.bounds == [None, None] and not single.excludes_zero
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])


def test_paired_interval_uses_per_seed_differences() -> None:
    # Differences 0.1, 0.2, 0.3 by seed, whatever the order the mappings list them in.
    first = {2: 0.9, 0: 0.5, 1: 0.7}
    second = {0: 0.4, 1: 0.5, 2: 0.6}
    interval = paired_interval(first, second)
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert interval.mean == pytest.approx(0.2)
    assert interval.bounds == pytest.approx([0.2 - half, 0.2 + half], abs=1e-6)
    with pytest.raises(ValueError, match="same seeds"):
        paired_interval({0: 1.0, 1: 1.0}, {0: 1.0, 2: 1.0})


def test_gain_is_the_mean_of_the_last_three_minus_step_zero() -> None:
    curve = {0: 0.2, 8: 0.1, 16: 0.3, 24: 0.4, 32: 0.5}
    assert gain(curve) == pytest.approx((0.3 + 0.4 + 0.5) / 3 - 0.2)
    with pytest.raises(ValueError, match="step-0"):
        gain({8: 0.1, 16: 0.3, 24: 0.4, 32: 0.5})
    with pytest.raises(ValueError, match="needs 4 evaluations"):
        gain({0: 0.1, 8: 0.3, 16: 0.4})
