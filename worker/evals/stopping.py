"""When a job may stop early (training.stop_when): a pure function of its evals so far.

- target: the newest eval's mean reward reached the target (the mean, not its lower bound: the user names
  the reward they would accept, and a greedy eval on fixed rows is what the job reports as its reward);
- plateau {evals: N}: the last N evals all failed to beat the best eval before them beyond the best's 95%
  interval (an eval beats it when its mean is above the best's upper bound; the step-0 baseline is the first
  best). A move inside the interval is what re-running the same eval on other rows could give, so it is not
  counted as progress, and an eval that falls is not either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class EvalPoint:
    step: int
    mean: float
    low: float  # the 95% interval of the mean (worker/evals/intervals.py)
    high: float


def best_index(evals: Sequence[EvalPoint]) -> int:
    """The eval that counts as the best: replaced only by one whose mean is above its interval."""
    best = 0
    for i, e in enumerate(evals[1:], start=1):
        if e.mean > evals[best].high:
            best = i
    return best


def stop_reason(evals: Sequence[EvalPoint], *, plateau_evals: int | None = None,
                target: float | None = None) -> str | None:
    """Why the job should stop after the newest eval (evals in step order), or None to go on."""
    if not evals:
        return None
    newest = evals[-1]
    if target is not None and newest.mean >= target:
        return f"target reached: the eval at step {newest.step} has mean reward {newest.mean:.4f} >= {target:g}"
    if plateau_evals is not None:
        best = best_index(evals)
        since = len(evals) - 1 - best
        if since >= plateau_evals:
            b = evals[best]
            return (f"plateau: none of the last {since} evals beat the best (step {b.step}, mean {b.mean:.4f}, "
                    f"95% interval up to {b.high:.4f}) beyond its interval (stop_when.plateau.evals = "
                    f"{plateau_evals})")
    return None
