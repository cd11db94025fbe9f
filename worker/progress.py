"""When a job will finish, from the step rate measured while it runs."""

from __future__ import annotations


class StepClock:
    """Estimates the finish time from wall-clock seconds per step since the first step this worker saw.

    Wall-clock time between steps includes evaluations and checkpoints, which a step's own
    step_seconds leaves out; until a second step is seen, step_seconds is all there is.
    """

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self._first: tuple[float, int] | None = None  # (time, step) of the first step seen

    def estimate(self, now: float, step: int, step_seconds: float) -> int:
        """Unix seconds at which the last step should end."""
        if self._first is None or step <= self._first[1]:
            self._first = (now, step)
            per_step = step_seconds
        else:
            per_step = (now - self._first[0]) / (step - self._first[1])
        return round(now + max(self.total_steps - step, 0) * max(per_step, 0.0))
