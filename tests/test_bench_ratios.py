"""The benchmark's chain ratios: the median over rounds of each round's ratio (pure)."""

import pytest

from bench.compare import median_ratio


def test_each_round_is_compared_with_the_best_of_its_own_round() -> None:
    ours = [{"ms": 4.0}, {"ms": 3.0}, {"ms": 10.0}]
    prefork = [{"ms": 2.0}, {"ms": 3.0}, {"ms": 5.0}]
    threads = [{"ms": 4.0}, {"ms": 1.5}, {"ms": 8.0}]
    # Lower is better: rounds give 4/2, 3/1.5 and 10/5, all 2.0, though the machine drifted
    # by more than 3x over the rounds; pooled medians would have given 4/3.
    assert median_ratio(ours, [prefork, threads], "ms", higher=False) == 2.0


def test_higher_is_better_takes_the_fastest_of_theirs() -> None:
    ours = [{"tps": 900.0}, {"tps": 600.0}, {"tps": 300.0}]
    theirs = [[{"tps": 600.0}, {"tps": 300.0}, {"tps": 100.0}],
              [{"tps": 450.0}, {"tps": 400.0}, {"tps": 300.0}]]  # fmt: skip
    # 900/600, 600/400, 300/300: the median of 1.5, 1.5 and 1.0
    assert median_ratio(ours, theirs, "tps", higher=True) == 1.5


def test_an_outlier_round_moves_the_median_less_than_the_mean() -> None:
    ours = [{"ms": 3.0}, {"ms": 3.0}, {"ms": 30.0}]
    theirs = [[{"ms": 2.0}, {"ms": 2.0}, {"ms": 2.0}]]
    assert median_ratio(ours, theirs, "ms", higher=False) == 1.5


def test_rounds_that_do_not_pair_up_are_refused() -> None:
    with pytest.raises(ValueError, match="one figure a round"):
        median_ratio([{"ms": 1.0}], [[{"ms": 1.0}, {"ms": 2.0}]], "ms", higher=False)
    with pytest.raises(ValueError, match="one figure a round"):
        median_ratio([], [[]], "ms", higher=False)
