"""Recipe knobs from the leading RL recipes (ScaleRL, AgileRL, QLoRA) that are sections of their own in the job spec.

Each is off by default, so a spec without them runs exactly as before. Torch-free, like the rest of the spec.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class OffPolicyMaskSpec(_Strict):
    """AgileRL's off-policy masks: tokens (and sequences) too far off-policy get no gradient at all.

    token_bounds: a token whose importance ratio exp(logp - logp_old) (at loss.importance_sampling_level) lies
    outside [low, high] is left out of the loss (IcePop's band, AgileRL's default (0.5, 5.0)); null: no token mask.
    sequence_threshold: a sequence whose mean log(pi_old / pi) over its action tokens exceeds it has its
    negative-advantage tokens left out (DeepSeek-V3.2's off-policy sequence masking; AgileRL uses 0.03);
    null: no sequence mask.
    """

    token_bounds: tuple[float, float] | None = (0.5, 5.0)
    sequence_threshold: float | None = Field(None, gt=0.0, le=10.0)

    @model_validator(mode="after")
    def _bounds(self) -> OffPolicyMaskSpec:
        if self.token_bounds is not None:
            low, high = self.token_bounds
            if not 0.0 <= low < 1.0 < high:
                raise ValueError(f"token_bounds ({low}, {high}) must satisfy 0 <= low < 1 < high: a band that "
                                 "leaves out ratio 1 would mask every on-policy token")
        if self.token_bounds is None and self.sequence_threshold is None:
            raise ValueError("give token_bounds, sequence_threshold or both (leave off_policy_mask out to disable)")
        return self


class PassRateFilterSpec(_Strict):
    """ScaleRL's no-positive-resampling: stop drawing prompts the policy already solves.

    After each step, a prompt whose group passed at a rate >= threshold (a completion passes when its reward is
    >= pass_reward) is retired: the sampler skips it from then on. With drop_zero_variance, a prompt whose group
    got one reward for every completion (nothing to learn from: all solved or all failed) is retired too.
    Retired prompts are kept in checkpoints; the sampler never retires the last prompt that is left.
    """

    threshold: float = Field(0.9, gt=0.0, le=1.0)
    pass_reward: float = Field(1.0, description="A completion passes when its reward is at least this.")
    drop_zero_variance: bool = False
