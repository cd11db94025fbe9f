"""How a running job is doing: when it will finish (from its measured step rate), and whether its reward moved."""

from __future__ import annotations

import math


class StepClock:
    """Estimates the finish time from wall-clock seconds per step since the first step this worker saw.

    Wall-clock time between steps includes evaluations and checkpoints, which a step's own
    step_seconds leaves out; until a second step is seen, step_seconds is all there is.
    """

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self._first: tuple[float, int] | None = None  # (time, step) of the first step seen

    def estimate(self, now: float, step: int, step_seconds: float) -> int:
        """Unix seconds at which the last step should end."""
        if self._first is None or step <= self._first[1]:
            self._first = (now, step)
            per_step = step_seconds
        else:
            per_step = (now - self._first[0]) / (step - self._first[1])
        return round(now + max(self.total_steps - step, 0) * max(per_step, 0.0))


def reward_trend(steps: list[tuple[float, float]], samples_per_step: int) -> tuple[bool | None, str]:
    """Whether the reward moved beyond noise over a run, from each step's (reward_mean, reward_std).

    Compares the first quarter of the steps with the last quarter (at least one step each): their pooled
    sample means differ by more than two standard errors of the difference (Welch). Completions of one group
    are not independent, so this is a rough test, meant to flag a run that learned nothing. Returns (moved,
    a sentence); moved is None when there are too few steps to compare."""
    if len(steps) < 2:
        return None, "too few steps to tell whether the reward moved"
    k = max(1, len(steps) // 4)

    def pooled(window: list[tuple[float, float]]) -> tuple[float, float, int]:
        mean = sum(m for m, _ in window) / len(window)
        second = sum(s * s + m * m for m, s in window) / len(window)  # equal samples per step
        return mean, max(second - mean * mean, 0.0), len(window) * samples_per_step

    (m1, v1, n1), (m2, v2, n2) = pooled(steps[:k]), pooled(steps[-k:])
    delta, se = m2 - m1, math.sqrt(v1 / n1 + v2 / n2)
    moved = abs(delta) > 2 * se and delta != 0
    verdict = "moved beyond noise" if moved else "did not move beyond noise"
    return moved, (f"reward {verdict}: {m1:.4f} over the first {k} step(s), {m2:.4f} over the last {k} "
                   f"({delta:+.4f}; 2 standard errors = {2 * se:.4f})")
