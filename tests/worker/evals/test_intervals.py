"""The eval intervals (worker/evals/intervals.py) against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from worker.evals.intervals import bootstrap, eval_metrics, mean_interval, paired_difference, wilson


def test_wilson_matches_the_hand_computed_interval():
    # 7 of 10: p = 0.7, z^2/n = 0.38415, centre = (0.7 + 0.19207) / 1.38415 = 0.64449,
    # half = 1.95996 * sqrt(0.021 + 0.0096037) / 1.38415 = 0.24771  ->  [0.39678, 0.89221]
    low, high = wilson(7, 10)
    assert low == pytest.approx(0.39678, abs=1e-5) and high == pytest.approx(0.89221, abs=1e-5)
    # 0 of 10: centre = half = 0.19207 / 1.38415 = 0.13877  ->  [0, 0.27753]; not the normal approximation's [0, 0]
    low, high = wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(0.27753, abs=1e-5)
    low, high = wilson(10, 10)
    assert low == pytest.approx(1 - 0.27753, abs=1e-5) and high == pytest.approx(1.0)


def test_zero_one_rewards_use_wilson_and_others_the_bootstrap():
    ci = mean_interval([1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    assert (ci.method, ci.mean, ci.n) == ("wilson", 0.7, 10)
    assert (ci.low, ci.high) == pytest.approx(wilson(7, 10))
    # Two values 0.2 and 0.8: a resampled mean is 0.2, 0.5 or 0.8 with chances 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% quantiles are 0.2 and 0.8.
    ci = mean_interval([0.2, 0.8])
    assert ci.method == "bootstrap" and ci.mean == pytest.approx(0.5)
    assert (ci.low, ci.high) == pytest.approx((0.2, 0.8))
    assert bootstrap([0.5, 0.5, 0.5]) == pytest.approx((0.5, 0.5))


def test_bootstrap_agrees_with_the_normal_approximation_on_many_rows():
    values = [(i * 37 % 101) / 100 for i in range(400)]
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    half = 1.96 * sd / math.sqrt(len(values))
    low, high = bootstrap(values)
    assert low == pytest.approx(mean - half, abs=0.006) and high == pytest.approx(mean + half, abs=0.006)
    assert bootstrap(values) == (low, high)  # seeded: the same rewards give the same interval


def test_paired_difference_is_over_the_same_rows():
    # Differences [1, 0, 0, 1]: mean 0.5; a resample of 4 has k ones with k ~ Binomial(4, 1/2), so P(mean = 0)
    # = P(mean = 1) = 1/16 > 2.5%: the interval is [0, 1].
    diff = paired_difference([1, 1, 0, 1], [0, 1, 0, 0])
    assert (diff.mean, diff.low, diff.high) == (0.5, 0.0, 1.0)
    # Every row up by exactly 0.25: no spread, a point interval (two unpaired intervals would overlap widely).
    diff = paired_difference([0.25, 0.5, 1.0], [0.0, 0.25, 0.75])
    assert (diff.mean, diff.low, diff.high) == pytest.approx((0.25, 0.25, 0.25))
    with pytest.raises(ValueError, match="same rows"):
        paired_difference([1, 0], [1])


def test_eval_metrics_report_the_difference_only_against_a_matching_baseline():
    metrics = eval_metrics([1, 0, 1, 1], [0, 0, 1, 0])
    assert metrics["eval_reward_diff"] == 0.5
    assert (metrics["eval_reward_ci_low"], metrics["eval_reward_ci_high"]) == pytest.approx(wilson(3, 4))
    assert set(eval_metrics([1, 0], None)) == {"eval_reward_ci_low", "eval_reward_ci_high"}
    assert "eval_reward_diff" not in eval_metrics([1, 0], [1, 0, 1])
