"""What a job optimizes and how: advantages, the CISPO loss, AdamW and the learning-rate schedule."""

from __future__ import annotations

import warnings
from typing import Annotated, Literal

from pydantic import Field, model_validator

from service.job_spec.strict import Strict
from service.schemas.recipe import OffPolicyMaskSpec


class AdvantageSpec(Strict):
    """Group-relative advantages (MiniMax-M1 Eq. 2; mean-only as in Dr.GRPO and AgileRL)."""

    scale: Literal["none", "group_std", "batch_std"] = Field(
        "none", description="'none': A = r - mean(group); 'group_std': divide by std(group) + eps; 'batch_std' "
        "(ScaleRL): divide by the std of every reward of the step's batch + eps."
    )
    eps: float = Field(1e-6, gt=0.0)
    clip: float | None = Field(None, gt=0.0, description="Clip advantages to [-clip, clip].")
    drop_zero_groups: bool = Field(
        False, description="Leave out groups whose rewards are all equal (they carry no signal)."
    )
    per_turn: bool = Field(
        False,
        description="Environments: each turn's actions get the group-relative advantage of their reward-to-go "
        "(the sum of the rewards from that turn on), compared within the group at the same turn index. "
        "Off: every action token gets the episode's advantage (episode reward = sum of turn rewards).",
    )


# The mask a job with stale batches (rollout.max_staleness > 0) gets unless its spec names one: the negative-advantage
# tokens of a sequence the policy has already moved away from (mean log(pi_old / pi) > 0.03, AgileRL's and
# DeepSeek-V3.2's threshold) are left out. A batch one version old was sampled before the last update, which
# already pushed its bad samples down; pushing them down again on the next step drained the toy task's policy into
# near-uniform junk (entropy -> ln V, reward -> 0, zero-variance groups that never recover) whatever logp_old the
# ratio took (docs/TRAINING.md, bench/README.md).
STALE_BATCH_MASK = {"token_bounds": None, "sequence_threshold": 0.03}


class CispoLossSpec(Strict):
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 3-5).

    ratio_max is an absolute cap on the detached importance weight, with no
    lower bound. Default 5.0: ScaleRL (arXiv 2510.13786) found 4-8 equally
    good and TRL's docs recommend 5.0 for loss_type="cispo".
    """

    type: Literal["cispo"] = "cispo"
    ratio_max: float = Field(5.0, ge=1.0, le=100.0)
    normalization: Literal["token", "sequence", "prompt"] = Field(
        "token",
        description="'token': divide by all action tokens of the optimizer step (the paper); "
        "'sequence': mean over tokens, then over sequences; 'prompt' (ScaleRL): mean over the tokens of each "
        "prompt's completions in the optimizer step, then over prompts.",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="'token': each token's ratio exp(logp - logp_old); 'sequence' (GSPO): every token of a "
        "sequence gets exp(mean over its action tokens of logp - logp_old). Capped at ratio_max either way.",
    )
    off_policy_mask: OffPolicyMaskSpec | None = Field(
        None, description="AgileRL's token and sequence masks for off-policy tokens; null: none. Left out of a job "
        "with rollout.max_staleness > 0, it is the sequence mask STALE_BATCH_MASK (give null to train without one)."
    )
    kl_beta: float = Field(0.0, ge=0.0, description="Weight of the k3 KL penalty to the reference.")
    kl_clamp: float = Field(10.0, gt=0.0, description="Per-token cap on the k3 KL estimate.")

    @model_validator(mode="after")
    def _warn_low_cap(self) -> CispoLossSpec:
        if self.ratio_max < 2.0:
            warnings.warn(
                f"loss.ratio_max={self.ratio_max} is below 2: the cap will bind on most "
                "off-policy tokens; later work uses 4-8",
                UserWarning,
                stacklevel=2,
            )
        return self


class OptimizerSpec(Strict):
    """AdamW. Betas and eps default to the MiniMax-M1 paper (section 3.2)."""

    lr: float = Field(1e-5, gt=0.0, le=1.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-15, gt=0.0, le=1e-3)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="None disables clipping.")

    @model_validator(mode="after")
    def _betas(self) -> OptimizerSpec:
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]={b} must be in [0, 1)")
        return self


class ConstantSchedule(Strict):
    type: Literal["constant"] = "constant"
    warmup_steps: int = Field(0, ge=0)


class CosineSchedule(Strict):
    type: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


Schedule = Annotated[ConstantSchedule | CosineSchedule, Field(discriminator="type")]
