"""training.stop_when's rule (worker/evals/stopping.py) on hand-built eval sequences."""

from __future__ import annotations

from worker.evals.stopping import EvalPoint, best_index, stop_reason


def e(step: int, mean: float, half: float = 0.1) -> EvalPoint:
    return EvalPoint(step, mean, mean - half, mean + half)


def test_target_fires_on_the_newest_mean():
    evals = [e(0, 0.2), e(5, 0.5)]
    assert stop_reason(evals, target=0.6) is None
    reason = stop_reason([*evals, e(10, 0.6)], target=0.6)
    assert reason.startswith("target reached: the eval at step 10 has mean reward 0.6000 >= 0.6")


def test_improvement_counts_only_beyond_the_best_evals_interval():
    # 0.25 and 0.29 are inside the baseline's interval (up to 0.3): not progress; 0.31 is.
    assert best_index([e(0, 0.2), e(5, 0.25), e(10, 0.29)]) == 0
    assert best_index([e(0, 0.2), e(5, 0.25), e(10, 0.31)]) == 2
    # the best then moves: 0.35 is inside 0.31's interval (up to 0.41)
    assert best_index([e(0, 0.2), e(10, 0.31), e(15, 0.35)]) == 1


def test_plateau_after_n_evals_without_improvement():
    evals = [e(0, 0.2), e(5, 0.4), e(10, 0.45)]  # step 5 beat the baseline; step 10 did not beat step 5
    assert stop_reason(evals, plateau_evals=2) is None
    reason = stop_reason([*evals, e(15, 0.38)], plateau_evals=2)  # a fall is no improvement either
    assert reason.startswith("plateau: none of the last 2 evals beat the best (step 5, mean 0.4000")
    assert stop_reason([*evals, e(15, 0.55)], plateau_evals=2) is None  # 0.55 > 0.5: progress, count restarts


def test_no_rule_or_no_evals_never_stops():
    assert stop_reason([e(0, 0.2), e(5, 0.2), e(10, 0.2)]) is None
    assert stop_reason([], plateau_evals=1, target=0.0) is None


def test_both_rules_the_first_to_fire_wins():
    evals = [e(0, 0.2), e(5, 0.21)]
    assert stop_reason(evals, plateau_evals=1, target=0.9).startswith("plateau")
    assert stop_reason(evals, plateau_evals=5, target=0.21).startswith("target")
