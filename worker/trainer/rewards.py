"""Scoring a rollout with the job's reward.

``make_scorer(spec.reward, context)`` gives a Scorer for the job:

- ``import``: a trusted callable imported into this process (local CLI runs only;
  the service refuses this type);
- every service type (builtins, templates, python, http, score_model, multi):
  the torch-free engine in worker/rewards/engine.py, which keeps user Python
  in a sandboxed child process and remote calls behind the egress policy.

A reward that raises, times out, or returns something that is not a finite
number gives that sample the job's failure score and is counted, never
crashes the step or poisons the advantages with NaN. Close the scorer when
the job ends: it owns the sandbox children.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from service.job_spec.spec import ImportReward, Reward
from service.schemas.rewards import PythonReward
from worker.rewards.engine import FunctionBatchScorer, ScoringContext, build_scorer
from worker.rewards.outcome import BatchScorer, Outcome

RewardFn = Callable[..., float]  # fn(completion, **row) -> float


@dataclass
class Scores:
    rewards: torch.Tensor  # (sequences,)
    errors: list[str] = field(default_factory=list)  # one message per failed sample
    components: dict[str, list[float | None]] = field(default_factory=dict)  # a multi reward's parts


class Scorer(Protocol):
    def score(self, completions: list[str], rows: list[dict], *, failure_score: float) -> Scores: ...
    def close(self) -> None: ...


def component_metrics(scores: Scores) -> dict[str, float]:
    """``reward/<name>_mean`` over the samples each part scored, and ``reward/<name>_errors``."""
    metrics = {}
    for name, values in scores.components.items():
        ok = [v for v in values if v is not None]
        if ok:
            metrics[f"reward/{name}_mean"] = sum(ok) / len(ok)
        metrics[f"reward/{name}_errors"] = float(len(values) - len(ok))
    return metrics


class EngineScorer:
    """A BatchScorer's Outcome as tensors, failed samples set to the failure score."""

    def __init__(self, batch: BatchScorer):
        self.batch = batch

    def score(self, completions: list[str], rows: list[dict], *, failure_score: float) -> Scores:
        outcome: Outcome = self.batch.score(completions, rows)
        rewards = [failure_score if s is None else s for s in outcome.scores]
        return Scores(rewards=torch.tensor(rewards, dtype=torch.float32), errors=outcome.error_list(),
                      components={n: part.scores for n, part in outcome.components.items()})

    def close(self) -> None:
        self.batch.close()


class InProcessScorer(EngineScorer):
    """Calls ``fn(completion, row)`` here, for each sample: trusted code only ('import' rewards, tests)."""

    def __init__(self, fn: Callable[[str, dict], Any]):
        super().__init__(FunctionBatchScorer(fn))

    @classmethod
    def from_callable(cls, fn: RewardFn) -> InProcessScorer:
        """For a ``fn(completion, **row)`` reward, as 'import' names and tests pass."""
        return cls(lambda completion, row: fn(completion, **row))


class SandboxScorer(EngineScorer):
    """A top-level ``python`` reward; ``process`` is its PythonRewardProcess."""

    @property
    def process(self):
        return self.batch.process


def resolve_import(spec: ImportReward) -> RewardFn:
    module_name, _, attr = spec.path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.path {spec.path!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward.path {spec.path!r} is not callable")
    return fn


def make_scorer(spec: Reward, context: ScoringContext | None = None) -> Scorer:
    if isinstance(spec, ImportReward):
        return InProcessScorer.from_callable(resolve_import(spec))
    batch = build_scorer(spec, context)
    return SandboxScorer(batch) if isinstance(spec, PythonReward) else EngineScorer(batch)
