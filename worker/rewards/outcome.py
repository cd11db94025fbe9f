"""What scoring a batch gives: a score or an error per sample, plus the parts of a combined reward.

Plain lists, no torch: the trainer turns an Outcome into tensors
(worker/trainer/rewards.py), the API's test runner into JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Outcome:
    scores: list[float | None]  # None where the sample failed
    errors: list[str | None]  # the failure, where scores has None
    components: dict[str, Outcome] = field(default_factory=dict)  # a multi reward's sub-rewards, by name
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # judge model -> token counts

    @classmethod
    def empty(cls, n: int) -> Outcome:
        return cls(scores=[None] * n, errors=[None] * n)

    def error_list(self) -> list[str]:
        return [e for e in self.errors if e is not None]


class BatchScorer(Protocol):
    """Scores a batch; a failed sample is an error in the Outcome, never an exception."""

    def score(self, completions: list[str], rows: list[dict]) -> Outcome: ...
    def close(self) -> None: ...


def add_usage(total: dict[str, dict[str, int]], model: str, usage: dict) -> None:
    counts = total.setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
    for key in counts:
        value = usage.get(key) if isinstance(usage, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            counts[key] += value
