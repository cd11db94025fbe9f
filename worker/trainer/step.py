"""One optimizer step's pieces that every update path shares: a micro-batch's CISPO loss from the job spec, and
the clipped optimizer step.

The trainer alone (worker/trainer/update.py), the resident jobs on a shared base (worker/multi/update.py) and
supervised fine-tuning (worker/trainer/supervised.py) call these, so the paths cannot drift apart: a knob of
the loss section read in one place reaches every path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from service.job_spec.spec import JobSpec
from worker.cispo import LossInputs, LossOutput, cispo_loss


def scatter(per_seq: dict[int, Tensor], idx: list[int], mask_BT: Tensor, like_BT: Tensor) -> Tensor:
    """Place per-sequence action-token values back into a (B, T) tensor shaped like the batch."""
    out = torch.zeros_like(like_BT, dtype=like_BT.dtype).detach()
    out[mask_BT] = torch.cat([per_seq[i] for i in idx]).to(device=out.device, dtype=out.dtype)
    return out


def off_policy_options(loss_spec) -> dict:
    """cispo_loss's importance-ratio level and AgileRL masks, from the spec's loss section."""
    mask = loss_spec.off_policy_mask
    return {"importance_sampling_level": loss_spec.importance_sampling_level,
            "token_mask_bounds": None if mask is None else mask.token_bounds,
            "sequence_mask_threshold": None if mask is None else mask.sequence_threshold}


def micro_batch_loss(spec: JobSpec, micro: list[int], logp: Tensor, action_mask_BT: Tensor, normalizer: float,
                     *, token_adv: dict[int, Tensor], old: dict[int, Tensor] | None, ref: dict[int, Tensor] | None,
                     sampler: dict[int, Tensor] | None, weight_of: dict[int, float] | None) -> LossOutput:
    """The CISPO loss of the micro-batch `micro` (its rows' log-probs `logp`), as the job's loss section says.

    The dicts hold each sequence's action-token values: advantages, and the log-probs of the rollout policy
    (None: `logp` detached, ratio 1), the reference (None: no KL) and the sampler (None: no TIS correction).
    `weight_of`: each sequence's weight under prompt normalisation, else None.
    """
    mask = action_mask_BT.bool()
    loss = spec.loss
    return cispo_loss(
        LossInputs(
            logprobs_BT=logp,
            old_logprobs_BT=logp.detach() if old is None else scatter(old, micro, mask, logp),
            advantages_B=scatter(token_adv, micro, mask, logp),
            action_mask_BT=action_mask_BT,
            ref_logprobs_BT=None if ref is None else scatter(ref, micro, mask, logp),
            sampler_logprobs_BT=None if sampler is None else scatter(sampler, micro, mask, logp),
        ),
        normalizer=normalizer,
        ratio_max=loss.ratio_max,
        kl_beta=loss.kl_beta,
        kl_clamp=loss.kl_clamp,
        per_sequence=loss.normalization == "sequence",
        tis_cap=spec.rollout.tis_cap,
        sequence_weights_B=None if weight_of is None else logp.new_tensor([weight_of[i] for i in micro]),
        **off_policy_options(loss),
    )


def optimizer_step(params, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> float:
    """Clip the accumulated gradients' norm to max_grad_norm (None: no clipping), step; the norm before clipping.

    Under FSDP2 the norm comes back as a DTensor, whose full value is the norm over every rank's shard.
    """
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    optimizer.step()
    return norm
