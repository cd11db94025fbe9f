"""Is there anything to learn from? Pre-flight before step 1, and a watch on zero-variance steps.

CISPO learns only from groups whose completions got different rewards: a
group whose rewards are all equal has zero advantages and moves nothing. A
reward that can never tell completions apart (a string check on rows it
cannot match, a constant) would otherwise train for hours with loss 0 and
end "succeeded". So before step 1 the trainer samples a few groups from the
starting policy and scores them (the baseline reward and the share of groups
with zero variance are reported), and while it trains it counts consecutive
steps on which every group had zero variance. `training.fail_on_no_signal`
turns both findings into a failure (error code `no_learning_signal`).
"""

from __future__ import annotations

import random


class NoLearningSignal(Exception):
    """Every sampled group got one reward for all its completions: the update has nothing to learn from."""


def preflight_rows(rows: list[dict], groups: int, seed: int) -> list[dict]:
    """`groups` rows picked with the job's seed but by their own generator, so training draws the same prompts."""
    picker = random.Random(seed ^ 0x5EED)
    return picker.sample(rows, min(groups, len(rows)))


def preflight_message(metrics: dict[str, float]) -> str:
    share = metrics["preflight_zero_variance_fraction"]
    text = (f"Pre-flight: {int(metrics['preflight_groups'])} groups sampled from the starting policy; baseline "
            f"reward {metrics['preflight_reward_mean']:.4f} (std {metrics['preflight_reward_std']:.4f}); "
            f"{share:.0%} of groups have zero reward variance")
    if share >= 1.0:
        text += (" (no learning signal: every completion of a group got the same reward, so the advantages are "
                 "zero; check that the reward can tell completions apart on these rows)")
    return text


def no_signal_message(step: int, steps: int) -> str:
    return (f"No learning signal: every group had zero reward variance on each of the last {steps} steps (up to "
            f"step {step}); the updates change nothing. Check that the reward can tell completions apart, or "
            "raise sampling.temperature / training.group_size")


class ZeroVarianceWatch:
    """Counts consecutive steps on which every group had zero variance; says when the streak reaches `limit`."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def update(self, zero_group_fraction: float) -> bool:
        """True once per streak, on the step the streak reaches the limit."""
        self.streak = self.streak + 1 if zero_group_fraction >= 1.0 else 0
        return self.streak == self.limit
