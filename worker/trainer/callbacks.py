"""What a training run reports to whoever runs it (the job runner, the CLI, tests) and what it returns."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Callbacks(Protocol):
    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_eval(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_checkpoint(self, step: int, path: Path) -> None: ...
    def should_stop(self) -> bool: ...
    # Optional: on_reward_errors(step, errors: list[str]), the messages of a step's samples that failed to
    # score (callbacks without it are skipped, see _report_reward_errors); on_samples(step, samples: list[dict]),
    # a few of the step's completions (worker/trainer/samples.py); on_preflight(metrics), the pre-flight's
    # baseline before step 1; on_no_signal(step, steps), every group had zero variance for `steps` steps
    # (worker/trainer/learning_signal.py); on_warning(step, message: str), e.g. a compiled decode that fell
    # back to eager.


class NoCallbacks:
    def on_step(self, step, metrics): pass
    def on_eval(self, step, metrics): pass
    def on_checkpoint(self, step, path): pass
    def on_reward_errors(self, step, errors): pass
    def should_stop(self): return False


@dataclass
class TrainResult:
    steps_done: int
    stopped: bool  # should_stop() ended the run early
    last_checkpoint: Path | None
    first_eval: dict[str, float] | None
    last_eval: dict[str, float] | None
