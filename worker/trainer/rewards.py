"""Scoring a rollout with the job's reward.

``make_scorer(spec.reward)`` gives a Scorer for the job:

- ``import``: a trusted callable imported into this process (local CLI runs only;
  the service refuses this type);
- builtins (``exact_match``, ``contains``, ``regex``, ``numeric_match``): our own
  pure functions, in-process;
- ``python``: user source, run in a sandboxed child process
  (worker/rewards/sandbox.py), never in this one.

A reward that raises, times out, or returns something that is not a finite
number gives that sample the job's failure score and is counted, never
crashes the step or poisons the advantages with NaN. Close the scorer when
the job ends: it owns the sandbox child.
"""

from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from service.schemas.job_spec import ImportReward, Reward
from service.schemas.rewards import PythonReward
from worker.rewards.builtins import builtin_reward
from worker.rewards.sandbox import PythonRewardProcess

RewardFn = Callable[..., float]  # fn(completion, **row) -> float


@dataclass
class Scores:
    rewards: torch.Tensor  # (sequences,)
    errors: list[str] = field(default_factory=list)  # one message per failed sample


class Scorer(Protocol):
    def score(self, completions: list[str], rows: list[dict], *, failure_score: float) -> Scores: ...
    def close(self) -> None: ...


def _as_score(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return value


class InProcessScorer:
    """Calls ``fn(completion, row)`` here, for each sample: trusted code only (our builtins, 'import' rewards)."""

    def __init__(self, fn: Callable[[str, dict], Any]):
        self.fn = fn

    @classmethod
    def from_callable(cls, fn: RewardFn) -> InProcessScorer:
        """For a ``fn(completion, **row)`` reward, as 'import' names and tests pass."""
        return cls(lambda completion, row: fn(completion, **row))

    def score(self, completions: list[str], rows: list[dict], *, failure_score: float) -> Scores:
        rewards, errors = [], []
        for completion, row in zip(completions, rows, strict=True):
            try:
                value = _as_score(self.fn(completion, row))
            except Exception as e:  # any failure is the sample's, not the job's
                errors.append(f"{type(e).__name__}: {e}")
                value = failure_score
            rewards.append(value)
        return Scores(rewards=torch.tensor(rewards, dtype=torch.float32), errors=errors)

    def close(self) -> None:
        pass


class SandboxScorer:
    """User Python source, scored batch by batch in a PythonRewardProcess child."""

    def __init__(self, process: PythonRewardProcess):
        self.process = process

    def score(self, completions: list[str], rows: list[dict], *, failure_score: float) -> Scores:
        result = self.process.score(completions, rows)
        rewards = [failure_score if s is None else s for s in result.scores]
        errors = [e for e in result.errors if e is not None]
        return Scores(rewards=torch.tensor(rewards, dtype=torch.float32), errors=errors)

    def close(self) -> None:
        self.process.close()


def resolve_import(spec: ImportReward) -> RewardFn:
    module_name, _, attr = spec.path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.path {spec.path!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward.path {spec.path!r} is not callable")
    return fn


def make_scorer(spec: Reward) -> Scorer:
    if isinstance(spec, ImportReward):
        return InProcessScorer.from_callable(resolve_import(spec))
    if isinstance(spec, PythonReward):
        return SandboxScorer(PythonRewardProcess(spec.source, spec.entry_point))
    return InProcessScorer(builtin_reward(spec))
