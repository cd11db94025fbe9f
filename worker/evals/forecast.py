"""Forecast a run's reward from its first part: a sigmoid of reward against compute (pure: numpy only).

    reward(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)        C: trained tokens so far (C = 0 gives R0)

ScaleRL (arXiv 2510.13786) fits this curve to predict a long run's asymptote A from its first part; B is
the curve's steepness and C_mid the compute at which half of the gain A - R0 is reached.

Fitting, without scipy: for a fixed (B, C_mid) the model is linear in R0 and A, so both have a closed form
and the residual sum of squares (RSS) of every (B, C_mid) on a fine log-spaced grid is a few array
operations; the best cell is then refined on a zoomed grid. No starting guess, no local minimum to fall into.

The asymptote's interval is a profile-likelihood interval: for each candidate A, the smallest RSS over
(R0, B, C_mid) with A held there; A is inside while RSS(A) / RSS_min <= 1 + F(1, n - 4) / (n - 4) (the
F-calibrated profile, right for the small n a forecast runs on). Why a profile and not a bootstrap: the
data before the midpoint say much about how far down the curve is but little about how high it goes, so
the asymptote's uncertainty is lopsided, which a profile shows and a symmetric error does not; it is
deterministic (the same points always give the same interval); and resampling residuals of 6-10 points
gives unstable intervals. When the interval reaches the end of the range searched for A, the data do not
bound the asymptote: the interval is reported as open and the forecast as not trustworthy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MIN_POINTS = 6  # four parameters: at least two residual degrees of freedom before anything is fitted
B_RANGE = (0.2, 8.0)  # steepness searched; a fit at either end is not trusted
C_MID_SPAN = (0.1, 100.0)  # C_mid searched within [0.1 x the smallest, 100 x the largest] positive compute
A_SPAN = 3.0  # A searched within the observed rewards widened by 3 x their range on each side
MAX_WIDTH_FRACTION = 1.0  # an asymptote interval wider than the observed reward range is not trusted
GRID_B, GRID_C = 60, 160
A_GRID = 201  # then each end of the interval is refined by bisection
# Two-sided 97.5% Student t quantiles for 1..30 degrees of freedom: F(1, v; 0.95) = t(v; 0.975)^2.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(dof: int) -> float:
    if dof < 1:
        raise ValueError("needs at least one degree of freedom")
    return _T975[dof - 1] if dof <= len(_T975) else 1.959963984540054 + 2.4 / dof  # close above 30


def sigmoid(compute, r0: float, a: float, b: float, c_mid: float) -> np.ndarray:
    """The curve at `compute` (trained tokens); R0 at zero compute."""
    return r0 + (a - r0) * _share(np.asarray(compute, dtype=np.float64), np.array([b]), np.array([c_mid]))[0]


def _share(c: np.ndarray, b: np.ndarray, c_mid: np.ndarray) -> np.ndarray:
    """1 / (1 + (C_mid / C)^B) for each (b, c_mid) pair (rows) at each compute (columns); 0 where C = 0."""
    with np.errstate(divide="ignore", over="ignore"):
        z = b[:, None] * (np.log(c_mid)[:, None] - np.log(np.where(c > 0, c, 1.0))[None, :])
        s = 1.0 / (1.0 + np.exp(np.clip(z, -700, 700)))
    return np.where(c[None, :] > 0, s, 0.0)


@dataclass(frozen=True)
class Fit:
    r0: float
    a: float
    b: float
    c_mid: float
    rss: float
    n: int
    b_at_bound: bool
    c_mid_at_bound: bool
    a_at_bound: bool = False

    def predict(self, compute) -> np.ndarray:
        return sigmoid(compute, self.r0, self.a, self.b, self.c_mid)


class _Grid:
    """Sufficient statistics of the two-parameter linear fits, one per (B, C_mid) cell."""

    def __init__(self, c: np.ndarray, y: np.ndarray, b: np.ndarray, c_mid: np.ndarray):
        self.b, self.c_mid = b, c_mid
        s = _share(c, b, c_mid)
        t = 1.0 - s
        self.ys, self.ss, self.yt, self.st, self.tt = s @ y, (s * s).sum(1), t @ y, (s * t).sum(1), (t * t).sum(1)
        self.yy = float(y @ y)

    def best_linear(self, a_range: tuple[float, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R0, A, RSS) per cell: least squares of y = R0 (1 - s) + A s with A in `a_range` (the RSS is a convex
        quadratic, so a cell whose free A lies outside has its optimum at the nearer end)."""
        det = self.tt * self.ss - self.st ** 2
        safe = np.where(np.abs(det) > 1e-300, det, np.nan)
        a = np.clip(np.nan_to_num((self.tt * self.ys - self.st * self.yt) / safe, nan=a_range[0]), *a_range)
        r0 = (self.yt - a * self.st) / np.maximum(self.tt, 1e-300)
        rss = self.yy - 2 * (r0 * self.yt + a * self.ys) + r0 ** 2 * self.tt + 2 * r0 * a * self.st + a ** 2 * self.ss
        return r0, a, np.where(np.isfinite(rss), rss, np.inf)

    def rss_at(self, a: np.ndarray) -> np.ndarray:
        """The smallest RSS over cells and R0 with the asymptote held at each value of `a`."""
        tt = np.maximum(self.tt, 1e-300)[:, None]
        rss = (self.yy - 2 * a[None, :] * self.ys[:, None] + a[None, :] ** 2 * self.ss[:, None]
               - (self.yt[:, None] - a[None, :] * self.st[:, None]) ** 2 / tt)
        return rss.min(axis=0)


def a_range(y: np.ndarray) -> tuple[float, float]:
    """The asymptotes searched: the observed rewards widened by A_SPAN x their range on each side."""
    span = max(float(y.max() - y.min()), 1e-6)
    return float(y.min()) - A_SPAN * span, float(y.max()) + A_SPAN * span


def _grids(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    positive = c[c > 0]
    lo, hi = math.log(positive.min() * C_MID_SPAN[0]), math.log(positive.max() * C_MID_SPAN[1])
    return np.geomspace(*B_RANGE, GRID_B), np.exp(np.linspace(lo, hi, GRID_C))


def fit_sigmoid(compute: Sequence[float], reward: Sequence[float]) -> Fit:
    """Least-squares fit of the curve: a grid over (B, log C_mid) with closed-form R0 and A, then two zooms."""
    c, y = np.asarray(compute, dtype=np.float64), np.asarray(reward, dtype=np.float64)
    if len(c) != len(y) or len(c) < 2 or not (c > 0).any():
        raise ValueError("a fit needs at least two points, one of them with compute > 0")
    b_grid, c_grid = _grids(c)
    b_all, c_all = (g.ravel() for g in np.meshgrid(b_grid, c_grid, indexing="ij"))
    grid, bounds = _Grid(c, y, b_all, c_all), a_range(y)
    r0, a, rss = grid.best_linear(bounds)
    i = int(np.argmin(rss))
    b_at_bound = i // GRID_C in (0, GRID_B - 1)
    c_at_bound = i % GRID_C in (0, GRID_C - 1)
    b_step, c_step = math.log(b_grid[1] / b_grid[0]), math.log(c_grid[1] / c_grid[0])
    best = (b_all[i], c_all[i], r0[i], a[i], rss[i])
    for _ in range(2):  # zoom: +-1 coarse cell around the best, 21 x 21 finer cells
        b_fine = best[0] * np.exp(np.linspace(-b_step, b_step, 21))
        b_fine = b_fine[(b_fine >= B_RANGE[0]) & (b_fine <= B_RANGE[1])]
        c_fine = best[1] * np.exp(np.linspace(-c_step, c_step, 21))
        bb, cc = (g.ravel() for g in np.meshgrid(b_fine, c_fine, indexing="ij"))
        r0, a, rss = _Grid(c, y, bb, cc).best_linear(bounds)
        j = int(np.argmin(rss))
        if rss[j] < best[4]:
            best = (bb[j], cc[j], r0[j], a[j], rss[j])
        b_step, c_step = b_step / 10, c_step / 10
    a_at_bound = bool(min(abs(best[3] - bounds[0]), abs(best[3] - bounds[1])) <= 1e-9 * (bounds[1] - bounds[0]))
    return Fit(r0=float(best[2]), a=float(best[3]), b=float(best[0]), c_mid=float(best[1]),
               rss=max(float(best[4]), 0.0), n=len(c), b_at_bound=bool(b_at_bound), c_mid_at_bound=bool(c_at_bound),
               a_at_bound=a_at_bound)


@dataclass(frozen=True)
class AsymptoteInterval:
    low: float
    high: float
    open_low: bool  # reached the lowest A searched: the data do not bound it from below
    open_high: bool


def asymptote_interval(compute: Sequence[float], reward: Sequence[float], fit: Fit) -> AsymptoteInterval:
    """95% profile-likelihood interval of A (F-calibrated: RSS(A) / RSS_min <= 1 + t^2 / (n - 4))."""
    c, y = np.asarray(compute, dtype=np.float64), np.asarray(reward, dtype=np.float64)
    dof = len(y) - 4
    if dof < 1:
        raise ValueError(f"an interval needs more than 4 points, got {len(y)}")
    a_grid = np.linspace(*a_range(y), A_GRID)
    b_grid, c_grid = _grids(c)
    b_all, c_all = (g.ravel() for g in np.meshgrid(b_grid, c_grid, indexing="ij"))
    grid = _Grid(c, y, b_all, c_all)
    profile = grid.rss_at(a_grid)
    # A floor keeps noise-free data from an interval of zero width by rounding alone.
    floor = max(fit.rss, 1e-12 * float(((y - y.mean()) ** 2).sum()), 1e-300)
    limit = floor * (1 + t975(dof) ** 2 / dof)
    inside = np.flatnonzero(profile <= limit)
    if inside.size == 0:  # the grid missed the fit's own A by less than a cell: the interval is that cell
        k = int(np.argmin(np.abs(a_grid - fit.a)))
        inside = np.array([k])
    first, last = int(inside[0]), int(inside[-1])

    def edge(inner: float, outer: float) -> float:
        """Where the profile crosses the limit between an A inside and one outside: bisection."""
        for _ in range(30):
            middle = (inner + outer) / 2
            if grid.rss_at(np.array([middle]))[0] <= limit:
                inner = middle
            else:
                outer = middle
        return inner

    low = a_grid[0] if first == 0 else edge(a_grid[first], a_grid[first - 1])
    high = a_grid[-1] if last == A_GRID - 1 else edge(a_grid[last], a_grid[last + 1])
    return AsymptoteInterval(float(min(low, fit.a)), float(max(high, fit.a)), open_low=first == 0,
                             open_high=last == A_GRID - 1)


def forecast(compute: Sequence[float], reward: Sequence[float], final_compute: float) -> dict:
    """The forecast a job shows: the asymptote with its interval, the reward predicted at `final_compute` (the
    compute the job will have trained at its last step), and whether to trust it (with the reason if not)."""
    n = len(compute)
    if n < MIN_POINTS or not any(c > 0 for c in compute):
        return {"points": n, "trustworthy": False,
                "reason": f"too few points to fit ({n}; the forecast needs {MIN_POINTS})"}
    if max(reward) - min(reward) <= 1e-9 * max(1.0, abs(max(reward))):
        return {"points": n, "trustworthy": False,
                "reason": f"every point has the same reward ({reward[0]:.4g}): the curve has not moved, so its "
                          "asymptote is not bounded by the data"}
    fit = fit_sigmoid(compute, reward)
    interval = asymptote_interval(compute, reward, fit)
    y = np.asarray(reward, dtype=np.float64)
    span = float(y.max() - y.min())
    reasons = []
    if fit.b_at_bound:
        reasons.append(f"the steepness B ({fit.b:.3g}) is at the end of its search range {B_RANGE}")
    if fit.c_mid_at_bound:
        reasons.append("the midpoint C_mid is at the end of its search range")
    if fit.a_at_bound:
        reasons.append("the asymptote A is at the end of its search range (the observed rewards widened by "
                       f"{A_SPAN:g} x their range)")
    if interval.open_low or interval.open_high:
        reasons.append("the data do not bound the asymptote (its interval is open)")
    elif interval.high - interval.low > MAX_WIDTH_FRACTION * span:
        reasons.append(f"the asymptote's interval ({interval.high - interval.low:.3g} wide) is wider than the "
                       f"observed rewards' range ({span:.3g})")
    out = {
        "asymptote": {"mean": fit.a, "interval": [interval.low, interval.high],
                      "open": [interval.open_low, interval.open_high]},
        "predicted_final_reward": float(fit.predict([final_compute])[0]),
        "parameters": {"r0": fit.r0, "a": fit.a, "b": fit.b, "c_mid": fit.c_mid},
        "points": n,
        "trustworthy": not reasons,
    }
    if reasons:
        out["reason"] = "; ".join(reasons)
    return out
