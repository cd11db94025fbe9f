"""Scoring a rollout with the job's reward function.

A reward that raises, or returns something that is not a finite number,
gives that sample the job's failure score and is counted, never crashes the
step or poisons the advantages with NaN.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from service.schemas.job_spec import ImportReward

RewardFn = Callable[..., float]


@dataclass
class Scores:
    rewards: torch.Tensor  # (sequences,)
    errors: list[str] = field(default_factory=list)  # one message per failed sample


def resolve_reward(spec: ImportReward) -> RewardFn:
    module_name, _, attr = spec.path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.path {spec.path!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward.path {spec.path!r} is not callable")
    return fn


def score(fn: RewardFn, completions: list[str], rows: list[dict], *, failure_score: float) -> Scores:
    rewards, errors = [], []
    for completion, row in zip(completions, rows):
        try:
            value = fn(completion, **row)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"returned {type(value).__name__}, not a number")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except Exception as e:  # user code: any failure is the sample's, not the job's
            errors.append(f"{type(e).__name__}: {e}")
            value = failure_score
        rewards.append(value)
    return Scores(rewards=torch.tensor(rewards, dtype=torch.float32), errors=errors)
