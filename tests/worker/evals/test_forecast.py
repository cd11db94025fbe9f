"""The sigmoid forecast (worker/evals/forecast.py) on synthetic curves with known parameters.

Tolerances: noise-free, the grid-and-zoom fit recovers every parameter (A and R0 within 0.005, B and C_mid
within 3%); with eval noise sd 0.03 on 21 points, A within 0.05 and the 95% profile interval covers the
true A in at least 10 of 12 noise draws; flat or too-short curves are reported as not trustworthy.
"""

from __future__ import annotations

import numpy as np
import pytest

from worker.evals.forecast import MIN_POINTS, asymptote_interval, fit_sigmoid, forecast, sigmoid, t975

TRUTH = {"r0": 0.2, "a": 0.8, "b": 1.5, "c_mid": 1e5}  # trained tokens: half the gain at 100k


def curve(n: int, c_max: float, noise: float = 0.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    c = np.linspace(0, c_max, n)
    y = sigmoid(c, TRUTH["r0"], TRUTH["a"], TRUTH["b"], TRUTH["c_mid"])
    return c, y + np.random.default_rng(seed).normal(0, noise, n)


def test_the_curve_starts_at_r0_and_is_halfway_at_c_mid():
    assert sigmoid([0.0, 1e5, 1e12], 0.2, 0.8, 1.5, 1e5).tolist() == pytest.approx([0.2, 0.5, 0.8], abs=1e-9)


def test_noise_free_parameters_are_recovered():
    c, y = curve(9, 4e5)
    fit = fit_sigmoid(c, y)
    assert (fit.r0, fit.a) == (pytest.approx(0.2, abs=0.005), pytest.approx(0.8, abs=0.005))
    assert fit.b == pytest.approx(1.5, rel=0.03) and fit.c_mid == pytest.approx(1e5, rel=0.03)
    out = forecast(c, y, final_compute=1e6)
    assert out["trustworthy"] and out["points"] == 9
    low, high = out["asymptote"]["interval"]
    assert low <= 0.8 + 0.005 and high >= 0.8 - 0.005 and high - low < 0.02
    assert out["predicted_final_reward"] == pytest.approx(float(sigmoid([1e6], *TRUTH.values())[0]), abs=0.005)


def test_noisy_asymptote_is_recovered_and_its_interval_covers_the_truth():
    covered = 0
    for seed in range(12):
        c, y = curve(21, 6e5, noise=0.03, seed=seed)
        fit = fit_sigmoid(c, y)
        assert fit.a == pytest.approx(0.8, abs=0.05), seed
        interval = asymptote_interval(c, y, fit)
        assert interval.low <= fit.a <= interval.high
        covered += interval.low <= 0.8 <= interval.high
    assert covered >= 10


def test_too_few_points_are_not_fitted():
    c, y = curve(MIN_POINTS - 1, 4e5)
    out = forecast(c, y, final_compute=1e6)
    assert out == {"points": MIN_POINTS - 1, "trustworthy": False,
                   "reason": f"too few points to fit ({MIN_POINTS - 1}; the forecast needs {MIN_POINTS})"}


def test_a_flat_curve_is_not_trustworthy():
    c = np.linspace(0, 4e5, 9)
    y = 0.3 + np.random.default_rng(1).normal(0, 0.02, 9)
    out = forecast(c, y, final_compute=1e6)
    assert not out["trustworthy"] and "do not bound the asymptote" in out["reason"]


def test_a_constant_curve_is_not_fitted():
    out = forecast(np.linspace(0, 4e5, 9), [0.0] * 9, final_compute=1e6)
    assert (out["trustworthy"], "asymptote" in out) == (False, False) and "has not moved" in out["reason"]


def test_a_curve_seen_only_before_its_midpoint_is_not_trustworthy():
    c, y = curve(8, 6e4, noise=0.02, seed=2)  # 60% of C_mid: the top of the curve is not in the data
    out = forecast(c, y, final_compute=1e6)
    assert not out["trustworthy"] and out["asymptote"]["open"][1]
    # the asymptote stays within the range searched (the observed rewards widened by 3 x their range)
    assert out["asymptote"]["mean"] <= y.max() + 3 * (y.max() - y.min()) + 1e-9


def test_t_quantiles():
    assert t975(1) == pytest.approx(12.706) and t975(30) == pytest.approx(2.042)
    assert t975(1000) == pytest.approx(1.962, abs=0.002)
