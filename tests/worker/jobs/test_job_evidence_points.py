"""Which curve the worker forecasts on, and at what compute (worker/jobs/job_evidence.py), from hand-built metrics."""

from __future__ import annotations

from worker.evals.forecast import MIN_POINTS
from worker.evals.stopping import EvalPoint
from worker.jobs.job_evidence import TRAIN_POINTS, curve_points, eval_points


def test_before_enough_evals_the_train_reward_is_used_at_cumulative_tokens():
    curve = {0: {"eval_reward_mean": 0.1}, 1: {"reward_mean": 0.2, "trained_tokens": 10},
             2: {"reward_mean": 0.3, "trained_tokens": 30, "eval_reward_mean": 0.25}}
    assert curve_points(curve) == ("train_reward", [10.0, 40.0], [0.2, 0.3], 40.0, 2)


def test_with_enough_evals_the_eval_curve_is_used_with_the_baseline_at_zero_compute():
    curve = {s: {"reward_mean": 0.0, "trained_tokens": 5.0, "eval_reward_mean": s / 10} for s in range(1, MIN_POINTS)}
    curve[0] = {"eval_reward_mean": 0.0}
    source, compute, reward, tokens, last = curve_points(curve)
    assert source == "eval" and compute == [5.0 * s for s in range(MIN_POINTS)]
    assert reward == [s / 10 for s in range(MIN_POINTS)] and (tokens, last) == (5.0 * (MIN_POINTS - 1), MIN_POINTS - 1)


def test_a_long_train_curve_is_averaged_down_to_train_points():
    curve = {s: {"reward_mean": float(s % 2), "trained_tokens": 1.0} for s in range(1, 2 * TRAIN_POINTS + 1)}
    source, compute, reward, _, _ = curve_points(curve)
    assert source == "train_reward" and len(compute) == TRAIN_POINTS
    assert compute[0] == 1.5 and reward == [0.5] * TRAIN_POINTS  # steps 1 and 2: mean compute, mean reward


def test_eval_points_carry_their_intervals_in_step_order():
    curve = {4: {"eval_reward_mean": 0.5, "eval_reward_ci_low": 0.3, "eval_reward_ci_high": 0.7},
             0: {"eval_reward_mean": 0.2}, 2: {"reward_mean": 0.4}}
    assert eval_points(curve) == [EvalPoint(0, 0.2, 0.2, 0.2), EvalPoint(4, 0.5, 0.3, 0.7)]
