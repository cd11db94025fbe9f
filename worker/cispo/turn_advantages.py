"""Per-turn group-relative advantages for multi-turn episodes.

Definition. Episode i of prompt p took K_i >= 1 turns with rewards
r_i,0 .. r_i,K_i-1. Its reward-to-go at turn k is R_i,k = sum_{t >= k} r_i,t
(so R_i,0 is the episode reward). Episode i takes part in turn index k when
k < K_i; every episode takes part in turn 0. Over the group's episodes that
take part in turn k:

    A_i,k = R_i,k - mean_j R_j,k        (divided by std_j R_j,k + eps with scale='group_std')

and A_i,k = 0 where all of them have the same reward-to-go (this includes a
turn only one episode reached). Every action token of turn k of episode i
gets A_i,k. Rewards already collected before turn k are left out (they do not
depend on that turn's actions), while rewards after it are credited to it.
At turn 0 this is exactly the episode-level advantage of ``group_advantages``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rewards_to_go(turn_rewards: list[float]) -> list[float]:
    out, running = [], 0.0
    for r in reversed(turn_rewards):
        running += r
        out.append(running)
    return out[::-1] or [0.0]


def turn_advantages(
    returns: list[list[float]],
    group_size: int,
    *,
    scale: str = "none",
    eps: float = 1e-6,
    clip: float | None = None,
) -> list[Tensor]:
    """One tensor of per-turn advantages per episode; ``returns[i]`` is R_i,0 .. R_i,K_i-1 (K_i >= 1)."""
    n = len(returns)
    if group_size < 2 or n % group_size:
        raise ValueError(f"{n} episodes do not form groups of {group_size} (group_size >= 2)")
    if any(not r for r in returns):
        raise ValueError("every episode needs the reward-to-go of at least turn 0")
    K = max(len(r) for r in returns)
    values = torch.zeros(n, K, dtype=torch.float64)
    valid = torch.zeros(n, K, dtype=torch.bool)
    for i, r in enumerate(returns):
        values[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        valid[i, : len(r)] = True
    if not torch.isfinite(values).all():
        raise ValueError("rewards must be finite")
    P = n // group_size
    values_PGK, valid_PGK = values.view(P, group_size, K), valid.view(P, group_size, K)
    count_PK = valid_PGK.sum(1).clamp(min=1)
    mean_PK = (values_PGK * valid_PGK).sum(1) / count_PK
    adv_PGK = values_PGK - mean_PK[:, None, :]
    if scale == "group_std":
        var_PK = ((adv_PGK**2) * valid_PGK).sum(1) / count_PK
        adv_PGK = adv_PGK / (var_PK.sqrt()[:, None, :] + eps)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}")
    if clip is not None:
        adv_PGK = adv_PGK.clamp(-clip, clip)
    big, small = torch.finfo(torch.float64).max, torch.finfo(torch.float64).min
    high = torch.where(valid_PGK, values_PGK, small).amax(1)
    low = torch.where(valid_PGK, values_PGK, big).amin(1)
    same_PK = high == low
    adv_PGK = torch.where(same_PK[:, None, :] | ~valid_PGK, 0.0, adv_PGK)
    flat = adv_PGK.reshape(n, K).float()
    return [flat[i, : len(r)] for i, r in enumerate(returns)]
