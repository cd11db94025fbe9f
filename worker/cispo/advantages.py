"""Group-relative advantages (GRPO / MiniMax-M1 Eq. 2).

A_i = r_i - mean(r_group), optionally divided by std(r_group) + eps. The
mean-only default follows Dr.GRPO and AgileRL's newest default: dividing by
a small group std inflates the advantages of near-solved prompts.

ScaleRL's batch-level normalisation ('batch_std') keeps the group mean as
the baseline but divides by the std of all the batch's rewards, one scale
for every group: a near-solved group's few differences stay small instead of
being blown up to unit size as 'group_std' does. With several processes the
caller passes the whole batch's std (``batch_std``), since each holds a share.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards_PG: Tensor,
    *,
    scale: str = "none",
    eps: float = 1e-6,
    clip: float | None = None,
    batch_std: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages for P prompts with G completions each.

    ``batch_std``: with scale 'batch_std', the std of the whole batch's rewards (default: of rewards_PG).
    Returns (advantages_PG, zero_group_P): the second marks groups whose
    rewards are all equal, which carry no learning signal.
    """
    if rewards_PG.ndim != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"rewards must be (prompts, group>=2), got {tuple(rewards_PG.shape)}")
    if not torch.isfinite(rewards_PG).all():
        raise ValueError("rewards must be finite")
    rewards_PG = rewards_PG.double()
    mean_P1 = rewards_PG.mean(dim=1, keepdim=True)
    advantages_PG = rewards_PG - mean_P1
    if scale == "group_std":
        std_P1 = rewards_PG.std(dim=1, keepdim=True, unbiased=False)
        advantages_PG = advantages_PG / (std_P1 + eps)
    elif scale == "batch_std":
        std = float(rewards_PG.std(unbiased=False)) if batch_std is None else batch_std
        advantages_PG = advantages_PG / (std + eps)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}")
    if clip is not None:
        advantages_PG = advantages_PG.clamp(-clip, clip)
    zero_group_P = (rewards_PG == rewards_PG[:, :1]).all(dim=1)
    advantages_PG = torch.where(zero_group_P[:, None], 0.0, advantages_PG)
    return advantages_PG.float(), zero_group_P
