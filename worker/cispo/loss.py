"""The CISPO objective (MiniMax-M1, arXiv 2506.13585, Eq. 3-5).

Per action token t of sequence i:

    ratio = exp(logp - logp_old)           logp_old frozen at rollout time
    w     = min(ratio, ratio_max)          detached; no lower bound (paper §3.1)
    loss  = -w * A_i * logp  [+ beta * k3(ref, logp)]

A_i may also be given per token (multi-turn episodes with per-turn
advantages, worker/cispo/turn_advantages.py). Tokens outside the action mask
(prompt, environment turns, padding) get exactly zero gradient.

Unlike PPO/GRPO clipping, the weight is clipped, not the update, so every
token keeps a gradient. The paper sets the lower bound out of reach and
tunes only the upper one; ratio_max is absolute (5.0 by default, see the
spec). Normalisation is token-level over the whole optimizer step, i.e. the
caller passes the step's total action-token count as ``normalizer`` and
sums the returned micro-batch losses (gradient accumulation then equals the
global token mean). With ``per_sequence`` each sequence's token mean is
averaged instead, and ``normalizer`` counts sequences.

The k3 estimator exp(ref - logp) - (ref - logp) - 1 is unbiased and
non-negative (Schulman, "Approximating KL divergence"); in the penalty it is
clamped per token at kl_clamp so a single runaway token cannot dominate. The
reported sums (kl_old, kl_ref) are the unclamped estimates, each over the
same action tokens, plus how many tokens the clamp bound (kl_ref_clamped).

Truncated importance sampling (TIS; verl PR #2953, AgileRL, TRL): when the
tokens were sampled by another engine (vLLM) whose log-probs differ a little
from the trainer's, the batch is off-policy even at ratio 1. Given the
sampler's log-probs, each policy-gradient term is also multiplied by

    tis   = min(exp(logp_old - logp_sampler), tis_cap)     detached

(the KL penalty is not: it is computed on trainer log-probs only). The
mismatch is reported whenever sampler log-probs are given, with or without
the correction: mean |logp_old - logp_sampler| and the k3 estimate of
KL(sampler || old) from the sampler's own tokens.

Recipe knobs (all off by default): the ratio may be taken per sequence
(GSPO's ``importance_sampling_level='sequence'``), tokens too far off-policy
may be masked out (AgileRL's ``token_mask_bounds`` and
``sequence_mask_threshold``, worker/cispo/off_policy.py), and each
sequence's terms may carry a weight with ``sequence_weights_B`` (prompt-level
aggregation, worker/cispo/aggregation.py), ``normalizer`` then being the
matching count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from worker.cispo.off_policy import log_importance_ratio, sequence_mask_keep, token_band_keep


@dataclass(frozen=True)
class LossInputs:
    logprobs_BT: Tensor  # current policy, carries the gradient
    old_logprobs_BT: Tensor  # policy that sampled the batch (frozen at rollout)
    advantages_B: Tensor  # (B,) per sequence, or (B, T) per token (per-turn advantages)
    action_mask_BT: Tensor  # 1 for generated tokens that are trained on
    ref_logprobs_BT: Tensor | None = None  # reference policy, when computed
    sampler_logprobs_BT: Tensor | None = None  # the rollout engine's own log-probs, when it reports them


@dataclass(frozen=True)
class LossOutput:
    loss: Tensor  # this micro-batch's share of the step loss
    ratio_N: Tensor  # importance ratios of the action tokens (detached), for quantiles
    sums: dict[str, Tensor]  # detached sums over action tokens; divide by 'tokens'


def k3_kl(logp: Tensor, other_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || other) from tokens sampled by pi: e^d - d - 1, d = other - logp."""
    delta = other_logp - logp
    return torch.exp(delta) - delta - 1.0


def truncated_is_weight(old_logp: Tensor, sampler_logp: Tensor, cap: float) -> Tensor:
    """Per-token min(exp(old - sampler), cap), detached: corrects for tokens drawn by a slightly different sampler."""
    return torch.exp((old_logp - sampler_logp).detach().clamp(-20.0, 20.0)).clamp(max=cap)


def cispo_loss(
    inputs: LossInputs,
    *,
    normalizer: float,
    ratio_max: float = 5.0,
    kl_beta: float = 0.0,
    kl_clamp: float = 10.0,
    per_sequence: bool = False,
    tis_cap: float | None = None,
    sequence_weights_B: Tensor | None = None,
    importance_sampling_level: str = "token",
    token_mask_bounds: tuple[float, float] | None = None,
    sequence_mask_threshold: float | None = None,
) -> LossOutput:
    """``tis_cap`` None or 0 leaves the truncated IS correction off (mismatch metrics are still reported).

    ``sequence_weights_B``: each sequence's terms are multiplied by its weight before the sum (replaces
    ``per_sequence``); the masks and the level are described in the module docstring."""
    if ratio_max < 1.0:
        raise ValueError(f"ratio_max must be >= 1, got {ratio_max}")
    if tis_cap and tis_cap < 1.0:
        raise ValueError(f"tis_cap must be >= 1 (or None/0 to disable), got {tis_cap}")
    if normalizer <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    logp = inputs.logprobs_BT
    mask = inputs.action_mask_BT.to(logp.dtype)
    log_ratio = (logp.detach() - inputs.old_logprobs_BT).clamp(-20.0, 20.0)
    ratio = torch.exp(log_importance_ratio(log_ratio, mask, importance_sampling_level))
    weight = ratio.clamp(max=ratio_max)  # detached: built from logp.detach()
    adv = inputs.advantages_B.to(logp.dtype)
    adv_BT = adv[:, None] if adv.ndim == 1 else adv
    loss_mask = mask  # the action tokens the loss sums over: all of them unless a mask drops some
    masking = token_mask_bounds is not None or sequence_mask_threshold is not None
    if masking:
        keep = token_band_keep(ratio, token_mask_bounds) & sequence_mask_keep(
            log_ratio, adv_BT.expand_as(log_ratio), mask, sequence_mask_threshold)
        loss_mask = mask * keep.to(mask.dtype)
    pg_weight = weight
    sampler = inputs.sampler_logprobs_BT
    tis = None
    if sampler is not None and tis_cap:
        tis = truncated_is_weight(inputs.old_logprobs_BT, sampler, tis_cap)
        pg_weight = weight * tis
    per_token = -pg_weight * adv_BT * logp

    kl_ref = None
    if inputs.ref_logprobs_BT is not None:
        kl_ref = k3_kl(logp, inputs.ref_logprobs_BT)
        if kl_beta > 0.0:
            per_token = per_token + kl_beta * kl_ref.clamp(max=kl_clamp)
    elif kl_beta > 0.0:
        raise ValueError("kl_beta > 0 needs ref_logprobs_BT")

    if sequence_weights_B is not None:
        loss = ((per_token * loss_mask).sum(-1) * sequence_weights_B.to(logp.dtype)).sum() / normalizer
    elif per_sequence:
        tokens_B = mask.sum(-1).clamp(min=1.0)
        loss = ((per_token * loss_mask).sum(-1) / tokens_B).sum() / normalizer
    else:
        loss = (per_token * loss_mask).sum() / normalizer

    with torch.no_grad():
        active = mask.bool()
        sums = {
            "tokens": mask.sum(),
            "clipped": ((ratio > ratio_max) & active).sum().to(logp.dtype),
            "kl_old": (k3_kl(logp.detach(), inputs.old_logprobs_BT) * mask).sum(),
            "pg_loss": (-pg_weight * adv_BT * logp.detach() * loss_mask).sum(),
        }
        if masking:
            sums["off_policy_masked"] = (mask - loss_mask).sum()
        if sampler is not None:
            old = inputs.old_logprobs_BT.detach()
            sums["sampler_abs_diff"] = ((old - sampler).abs() * mask).sum()
            sums["sampler_kl"] = (k3_kl(sampler, old) * mask).sum()
        if tis is not None:
            sums["tis_weight"] = (tis * mask).sum()
            sums["tis_capped"] = ((torch.exp(old - sampler) > tis_cap) & active).sum().to(logp.dtype)
        if kl_ref is not None:
            # The metric is the estimate itself, as kl_old is (the clamp only caps the penalty), so the two agree
            # whenever the reference and the rollout policy do, e.g. at a job's first step.
            sums["kl_ref"] = (kl_ref.detach() * mask).sum()
            sums["kl_ref_clamped"] = ((kl_ref.detach() > kl_clamp) & active).sum().to(logp.dtype)
    return LossOutput(loss=loss, ratio_N=ratio[active].detach(), sums=sums)
