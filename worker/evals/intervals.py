"""95% intervals for an eval's mean reward and for its paired difference to a baseline (pure: numpy only).

- The mean of 0/1 rewards (pass/fail): the Wilson score interval, which stays inside [0, 1] and is honest
  at small n and at 0 or n passes, where the normal approximation collapses to a point.
- Any other rewards, and every paired difference (values in {-1, 0, 1} even for 0/1 rewards): the
  percentile bootstrap over rows, with a fixed seed so the same rewards always give the same interval.

The paired difference compares two evals on the same rows (row i of each), so the row-to-row spread of
difficulty cancels and the interval is much narrower than two separate intervals would suggest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    method: str  # "wilson" | "bootstrap"

    def as_dict(self) -> dict:
        return {"mean": self.mean, "interval": [self.low, self.high], "n": self.n, "method": self.method}


def is_binary(values: Sequence[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def wilson(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a proportion successes / n."""
    if n <= 0:
        raise ValueError("an interval needs at least one value")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: the 2.5% and 97.5% quantiles of resampled means."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("an interval needs at least one value")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(low), float(high)


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean with its 95% interval: Wilson for 0/1 rewards, bootstrap otherwise."""
    values = [float(v) for v in values]
    mean = sum(values) / len(values) if values else float("nan")
    if is_binary(values):
        low, high = wilson(int(sum(values)), len(values))
        return Interval(mean, low, high, len(values), "wilson")
    low, high = bootstrap(values)
    return Interval(mean, low, high, len(values), "bootstrap")


def paired_difference(values: Sequence[float], baseline: Sequence[float]) -> Interval:
    """mean(values - baseline) over the same rows, with its bootstrap 95% interval."""
    if len(values) != len(baseline):
        raise ValueError(f"a paired difference needs the same rows: {len(values)} values, {len(baseline)} baseline")
    diffs = [float(a) - float(b) for a, b in zip(values, baseline)]
    low, high = bootstrap(diffs)
    return Interval(sum(diffs) / len(diffs), low, high, len(diffs), "bootstrap")


def eval_metrics(values: Sequence[float], baseline: Sequence[float] | None) -> dict[str, float]:
    """The interval metrics an in-job eval reports (beside eval_reward_mean): its 95% interval, and the paired
    difference to the baseline (the step-0 eval) with its interval when the baseline has the same rows."""
    ci = mean_interval(values)
    out = {"eval_reward_ci_low": ci.low, "eval_reward_ci_high": ci.high}
    if baseline is not None and len(baseline) == len(values):
        diff = paired_difference(values, baseline)
        out |= {"eval_reward_diff": diff.mean, "eval_reward_diff_ci_low": diff.low,
                "eval_reward_diff_ci_high": diff.high}
    return out
