"""Learning-rate schedules as a pure function of the step (no scheduler state to save)."""

from __future__ import annotations

import math

from service.job_spec.objective import ConstantSchedule, CosineSchedule


def lr_multiplier(schedule: ConstantSchedule | CosineSchedule, step: int, total_steps: int) -> float:
    """Multiplier for the base LR at 0-based trainer step `step` of `total_steps`.

    Linear warmup from 1/(warmup+1) so step 0 already learns; cosine decays
    to min_lr_ratio at the last step.
    """
    if step < schedule.warmup_steps:
        return (step + 1) / (schedule.warmup_steps + 1)
    if isinstance(schedule, ConstantSchedule):
        return 1.0
    decay_steps = max(1, total_steps - 1 - schedule.warmup_steps)
    progress = min(1.0, (step - schedule.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * cosine
