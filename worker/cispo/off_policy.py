"""Importance ratios at token or sequence level, and AgileRL's off-policy masks. Pure tensor functions.

Level (loss.importance_sampling_level):
    token      r_i,t = exp(logp_i,t - old_i,t)
    sequence   r_i,t = exp(mean_t' (logp_i,t' - old_i,t'))  for every action token t of sequence i (GSPO)

Masks (loss.off_policy_mask), each a keep-mask over action tokens:
    token band        keep where low <= r_i,t <= high (IcePop; AgileRL's default band (0.5, 5.0))
    sequence masking  drop the tokens with A_i,t < 0 of a sequence whose mean_t (old_i,t - logp_i,t) > delta:
                      the policy already moved away from what it sampled, and pushing such a sample further
                      down is what destabilises training (DeepSeek-V3.2's off-policy sequence masking)
A dropped token adds nothing to the loss or its gradient; the step's normaliser is unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sequence_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """(B,) mean of each row's values over its mask (0 for a row without any)."""
    mask = mask_BT.to(values_BT.dtype)
    return (values_BT * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def log_importance_ratio(log_ratio_BT: Tensor, mask_BT: Tensor, level: str) -> Tensor:
    """The log ratio each token is weighed by: its own (token), or its sequence's mean over action tokens."""
    if level == "token":
        return log_ratio_BT
    if level == "sequence":
        return masked_sequence_mean(log_ratio_BT, mask_BT)[:, None].expand_as(log_ratio_BT)
    raise ValueError(f"unknown importance_sampling_level {level!r}")


def token_band_keep(ratio_BT: Tensor, bounds: tuple[float, float] | None) -> Tensor:
    """True where the ratio lies inside [low, high] (everywhere when bounds is None)."""
    if bounds is None:
        return torch.ones_like(ratio_BT, dtype=torch.bool)
    low, high = bounds
    return (ratio_BT >= low) & (ratio_BT <= high)


def sequence_mask_keep(log_ratio_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor,
                       threshold: float | None) -> Tensor:
    """False on the negative-advantage tokens of sequences whose mean log(pi_old / pi) exceeds the threshold."""
    if threshold is None:
        return torch.ones_like(log_ratio_BT, dtype=torch.bool)
    drifted_B = masked_sequence_mean(-log_ratio_BT, mask_BT) > threshold
    return ~(drifted_B[:, None] & (advantages_BT < 0))
