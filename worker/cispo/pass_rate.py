"""Which prompts to stop sampling (ScaleRL's no-positive-resampling), from one step's group rewards.

A completion passes when its reward is >= pass_reward; a group's pass rate is
the share of its completions that pass. A prompt is retired when its group's
pass rate is >= threshold (ScaleRL: 0.9): the policy already solves it and
its group carries little or no signal. With drop_zero_variance, a group whose
rewards are all equal (all solved, or all failed) retires its prompt too.
"""

from __future__ import annotations

from torch import Tensor


def pass_rates(rewards_PG: Tensor, pass_reward: float) -> Tensor:
    """(P,) share of each group's completions whose reward is at least pass_reward."""
    return (rewards_PG >= pass_reward).double().mean(dim=1)


def prompts_to_retire(rewards_PG: Tensor, *, threshold: float, pass_reward: float = 1.0,
                      drop_zero_variance: bool = False) -> Tensor:
    """(P,) bool: the prompts of these groups that should not be sampled again."""
    if rewards_PG.ndim != 2:
        raise ValueError(f"rewards must be (prompts, group), got {tuple(rewards_PG.shape)}")
    retire_P = pass_rates(rewards_PG, pass_reward) >= threshold
    if drop_zero_variance:
        retire_P |= (rewards_PG == rewards_PG[:, :1]).all(dim=1)
    return retire_P
