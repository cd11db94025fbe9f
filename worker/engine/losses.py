"""The engine's losses: pure functions of one pass's per-token log-probs and loss inputs.

Every tensor is 1-D over the pass's positions (one datum's, or all its datums' end to end); each loss is a SUM
over positions, as Tinker defines them (the caller scales, e.g. by 1 / tokens, through the advantages or
weights it sends). Each returns (loss, metrics), metrics keyed "name:reduction".

    cross_entropy        -(weights * logp).sum()
    importance_sampling  -(ratio * A).sum()                                  ratio = exp(logp - sampler logp)
    ppo                  -min(ratio * A, clamp(ratio, low, high) * A).sum()
    cispo                -(min(ratio, high).detach() * A * logp).sum()       worker/cispo/loss.py's cispo_loss
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.cispo.loss import LossInputs, cispo_loss

PPO_CLIP = (0.8, 1.2)  # Tinker's default clip_low_threshold, clip_high_threshold
CISPO_RATIO_MAX = 5.0  # the job loss's default ratio_max (worker/cispo/loss.py)


def cross_entropy(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> tuple[Tensor, dict]:
    weights = inputs.get("weights")
    weights = torch.ones_like(logp) if weights is None else weights.to(logp.dtype)
    loss = -(weights * logp).sum()
    return loss, {"loss:sum": float(loss.detach())}


def _ratio(logp: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    return torch.exp(logp - _required(inputs, "logprobs").to(logp.dtype))


def importance_sampling(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> tuple[Tensor, dict]:
    ratio = _ratio(logp, inputs)
    loss = -(ratio * _required(inputs, "advantages").to(logp.dtype)).sum()
    return loss, {"loss:sum": float(loss.detach())}


def ppo(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> tuple[Tensor, dict]:
    low = float(config.get("clip_low_threshold", PPO_CLIP[0]))
    high = float(config.get("clip_high_threshold", PPO_CLIP[1]))
    ratio = _ratio(logp, inputs)
    adv = _required(inputs, "advantages").to(logp.dtype)
    clipped = ratio.clamp(low, high)
    loss = -torch.minimum(ratio * adv, clipped * adv).sum()
    with torch.no_grad():
        clip_frac = ((ratio < low) | (ratio > high)).to(logp.dtype).sum()
    return loss, {"loss:sum": float(loss.detach()), "clipped:sum": float(clip_frac)}


def cispo(logp: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> tuple[Tensor, dict]:
    """The job loss itself (one implementation): normalizer 1 makes its token mean a sum, and an all-ones action
    mask covers every position, so a position with advantage 0 adds exactly zero.

    Only the upper clip exists there: MiniMax's CISPO sets the lower bound out of reach (paper section 3.1), and
    its token_mask_bounds drops a token rather than clamping its weight, which is another loss. A lower threshold
    above 0 would therefore go unapplied; it is refused rather than silently ignored."""
    low = float(config.get("clip_low_threshold", 0.0))
    if low > 0.0:
        raise ValueError(f"cispo clips the importance weight from above only; clip_low_threshold {low} > 0 is not "
                         "served (send 0 or leave it out)")
    high = float(config.get("clip_high_threshold", CISPO_RATIO_MAX))
    old = _required(inputs, "logprobs").to(logp.dtype)
    out = cispo_loss(LossInputs(logprobs_BT=logp[None], old_logprobs_BT=old[None],
                                advantages_B=_required(inputs, "advantages").to(logp.dtype)[None],
                                action_mask_BT=torch.ones_like(old)[None]),
                     normalizer=1.0, ratio_max=high)
    return out.loss, {"loss:sum": float(out.loss.detach()), "clipped:sum": float(out.sums["clipped"]),
                      "kl_old:sum": float(out.sums["kl_old"])}


LOSSES = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo}


def loss_fn(name: str):
    """The loss called `name`; ValueError naming the served ones otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}: served are {', '.join(sorted(LOSSES))}") from None


def _required(inputs: dict[str, Tensor], key: str) -> Tensor:
    if key not in inputs:
        raise ValueError(f"this loss needs the datum input {key!r}")
    return inputs[key]
