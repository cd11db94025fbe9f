"""What one trainer step carries between its phases (worker/trainer/loop.py's begin_step -> sample ->
take_rollout -> update -> end_step), so that a caller interleaving the phases of many jobs (worker/multi/cycle.py)
runs the same step as Trainer.train_step."""

from __future__ import annotations

from dataclasses import dataclass

from worker.rollout.rollout import Rollout
from worker.trainer.feedback import Advantages, Feedback


@dataclass
class StepDraw:
    """A step's prompts (this rank's share) and the keyed streams their rollouts draw from."""

    rows: list[dict]
    sampling_seeds: list[int]
    episode_seeds: list[int]  # one per prompt with an environment, else none


@dataclass
class StepState:
    lr: float
    started: float  # perf_counter() when the step began
    rollout: Rollout | None = None
    rollout_s: float = 0.0
    feedback: Feedback | None = None
    advantages: Advantages | None = None
    errors: list[str] | None = None  # the whole step's reward errors (every rank's)
    indices: list[int] | None = None  # the sequences to train on
    fallbacks: list | None = None  # this decode's compile fallbacks; None: the decode was not this trainer's
    scored: object | None = None  # the asynchronous pipeline's batch (worker/trainer/pipeline.py), else None
    fresh: object | None = None  # which of the whole batch's sequences were fresh enough, asynchronously
