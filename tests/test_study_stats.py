"""mars2.study.stats against known answers (hand-counted patterns, Holm's worked example, scipy)."""

from __future__ import annotations

import math

import pytest

from mars2.study.stats import (
    describe,
    holm,
    minimum_detectable_effect,
    sign_flip_p,
    t_p,
    tost_p,
)


def test_sign_flip_p_of_small_known_vectors() -> None:
    # All positive: only the observed pattern is as large, 1 of 2^n.
    assert sign_flip_p([0.1, 0.2, 0.3]) == pytest.approx(1 / 8)
    assert sign_flip_p([0.1] * 10) == pytest.approx(1 / 1024)
    # [1, 2, -3]: sum 0; patterns of (±1, ±2, ±3) with sum >= 0: 4 of 8 (sums 6,2,0,0 ... -6).
    # sums: +1+2+3=6, -1+2+3=4, 1-2+3=2, -1-2+3=0, 1+2-3=0, -1+2-3=-2, 1-2-3=-4, -1-2-3=-6
    assert sign_flip_p([1, 2, -3]) == pytest.approx(5 / 8)
    assert sign_flip_p([1, 2, -3], "less") == pytest.approx(5 / 8)
    assert sign_flip_p([1, 2, -3], "two-sided") == pytest.approx(1.0)
    # [3, 1, 1]: sum 5; patterns with sum >= 5: (3,1,1) and (3,-1,1)? 3-1+1 = 3: no. Only 1 of 8.
    assert sign_flip_p([3, 1, 1]) == pytest.approx(1 / 8)
    # [3, -1, 1] (sum 3): sums >= 3 are 5, 3, 3 -> 3 of 8.
    assert sign_flip_p([3, -1, 1]) == pytest.approx(3 / 8)
    # Zeros flip to themselves: [0, 0] has every pattern tie at 0.
    assert sign_flip_p([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError):
        sign_flip_p([])


def test_sign_flip_p_counts_float_ties() -> None:
    # 0.1 + 0.2 vs 0.3 differ in the last bit: one pattern ties and must count.
    assert sign_flip_p([0.1, 0.2, -0.3]) == sign_flip_p([1, 2, -3])


def test_holm_on_known_p_values() -> None:
    # Holm (1979)-style example: sorted p 0.01, 0.04, 0.03 -> 3x0.01, max(0.03, 2x0.03), 0.06 ...
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.2, 0.01]) == pytest.approx([0.2, 0.02])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped, monotone
    assert holm([0.04]) == pytest.approx([0.04])


def test_tost_reads_equivalence_only_inside_the_margin() -> None:
    near = [0.001, -0.002, 0.003, 0.0, -0.001, 0.002, 0.001, -0.003, 0.002, 0.0]
    far = [0.05, 0.06, 0.04, 0.05, 0.07, 0.05, 0.06, 0.04, 0.05, 0.06]
    assert tost_p(near, 0.03) < 1e-6
    assert tost_p(far, 0.03) > 0.5
    assert tost_p([0.01, 0.01], 0.03) is None  # no spread


def test_mde_grows_with_spread_and_shrinks_with_n() -> None:
    small = minimum_detectable_effect(0.02, 10, 0.05)
    assert small is not None
    assert minimum_detectable_effect(0.04, 10, 0.05) == pytest.approx(2 * small)
    assert minimum_detectable_effect(0.02, 40, 0.05) < small
    # (t_0.95,9 + t_0.8,9) * sd / sqrt(n) = (1.8331 + 0.8834) * 0.02 / sqrt(10)
    assert small == pytest.approx((1.833113 + 0.883408) * 0.02 / math.sqrt(10), rel=1e-4)


scipy_stats = pytest.importorskip("scipy.stats", reason="scipy is in the dev extra")


@pytest.mark.parametrize(
    "diffs",
    [
        [0.03, -0.01, 0.05, 0.02, 0.0, 0.04, -0.02, 0.01, 0.06, 0.02],
        [-0.1, 0.2, 0.05, -0.03, 0.07],
        [0.5, 0.1, 0.3],
    ],
)
def test_intervals_and_t_tests_match_scipy(diffs: list[float]) -> None:
    d = describe(diffs, "greater", 0.03, 0.95, 0.05, 3)
    n = len(diffs)
    mean = sum(diffs) / n
    sem = scipy_stats.sem(diffs)
    low, high = scipy_stats.t.interval(0.95, n - 1, loc=mean, scale=sem)
    assert d["ci"] == pytest.approx([low, high], abs=1e-9)
    for direction, alternative in (("greater", "greater"), ("less", "less"),
                                   ("two-sided", "two-sided")):  # fmt: skip
        expected = scipy_stats.ttest_1samp(diffs, 0.0, alternative=alternative).pvalue
        assert t_p(diffs, direction) == pytest.approx(expected, abs=1e-9)
    lower = scipy_stats.ttest_1samp(diffs, -0.03, alternative="greater").pvalue
    upper = scipy_stats.ttest_1samp(diffs, 0.03, alternative="less").pvalue
    assert tost_p(diffs, 0.03) == pytest.approx(max(lower, upper), abs=1e-9)
    assert d["mde"] == pytest.approx(
        (scipy_stats.t.ppf(1 - 0.05 / 3, n - 1) + scipy_stats.t.ppf(0.8, n - 1))
        * scipy_stats.tstd(diffs) / math.sqrt(n), rel=1e-6)  # fmt: skip


def test_sign_flip_matches_scipy_permutation_test() -> None:
    diffs = [0.03, -0.01, 0.05, 0.02, 0.004, 0.04, -0.02, 0.01]
    result = scipy_stats.permutation_test(
        (diffs,), lambda x: sum(x), permutation_type="samples", alternative="greater",
        n_resamples=10_000,
    )  # fmt: skip
    assert sign_flip_p(diffs) == pytest.approx(result.pvalue, abs=1e-12)
