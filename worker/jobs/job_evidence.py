"""Whether a running job is working, as its reporter sees it: the forecast, the early stop and the best checkpoint.

- forecast: refit at every eval, and every `total_steps / FORECAST_REFITS` steps while it is on the train
  reward (a fit takes a fraction of a second of CPU) from the recorded curve (service/repositories/job_evidence.py): the eval curve once it has
  forecast.MIN_POINTS evals, else the train-reward curve (binned to at most TRAIN_POINTS points), against
  compute = trained tokens so far. Stored on the job (job.forecast) for the API to show.
- stop_when: after each eval, worker/evals/stopping.py on the evals so far; when it fires, an event says
  why, `stop_reason` is set and should_stop() ends the run at this step (checkpointed); the job runner
  then ends the job as succeeded.
- best checkpoint: after each checkpoint, the kept checkpoint with the best eval is named on the job; with
  training.keep_best it is spared by the retention (checkpoint_keep).
"""

from __future__ import annotations

import logging
import math

from sqlalchemy.orm import Session, sessionmaker

from service.job_spec.spec import TrainingSpec
from service.repositories import job_evidence
from service.repositories.job_history import TOKENS
from worker.evals.forecast import MIN_POINTS, forecast
from worker.evals.stopping import EvalPoint, stop_reason

log = logging.getLogger(__name__)

FORECAST_REFITS = 50  # refits on train-reward steps over a whole run, at most (evals refit too)
TRAIN_POINTS = 100


def curve_points(curve: dict[int, dict[str, float]]) -> tuple[str, list[float], list[float], float, int]:
    """(source, compute, reward, tokens so far, last step with tokens) from step -> metrics.

    source "eval" once there are MIN_POINTS evals (the step-0 baseline at compute 0 among them), else
    "train_reward": each step's mean train reward, averaged over equal runs of steps down to TRAIN_POINTS."""
    cumulative, total, last = {}, 0.0, 0
    for step in sorted(curve):
        total += curve[step].get(TOKENS, 0.0)
        cumulative[step] = total
        if curve[step].get(TOKENS):
            last = step
    evals = [(cumulative[s], m["eval_reward_mean"]) for s, m in sorted(curve.items()) if "eval_reward_mean" in m]
    if len(evals) >= MIN_POINTS:
        return "eval", [c for c, _ in evals], [r for _, r in evals], total, last
    train = [(cumulative[s], m["reward_mean"]) for s, m in sorted(curve.items()) if s > 0 and "reward_mean" in m]
    if len(train) > TRAIN_POINTS:
        size = -(-len(train) // TRAIN_POINTS)
        train = [(sum(c for c, _ in chunk) / len(chunk), sum(r for _, r in chunk) / len(chunk))
                 for chunk in (train[i:i + size] for i in range(0, len(train), size))]
    return "train_reward", [c for c, _ in train], [r for _, r in train], total, last


def eval_points(curve: dict[int, dict[str, float]]) -> list[EvalPoint]:
    out = []
    for step, m in sorted(curve.items()):
        if "eval_reward_mean" in m:
            mean = m["eval_reward_mean"]
            out.append(EvalPoint(step, mean, m.get("eval_reward_ci_low", mean), m.get("eval_reward_ci_high", mean)))
    return out


def _finite(value):
    """JSON columns cannot hold NaN or infinity everywhere: such a number is stored as null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JobEvidence:
    def __init__(self, sessions: sessionmaker[Session], job_id: str, epoch: int, total_steps: int,
                 training: TrainingSpec | None):
        self.sessions, self.job_id, self.epoch, self.total_steps = sessions, job_id, epoch, total_steps
        self.stop_when = training.stop_when if training is not None else None
        self.keep_best = bool(training is not None and training.keep_best)
        self.refit_every = max(1, total_steps // FORECAST_REFITS)
        self.stop_reason: str | None = None  # set when stop_when fired
        self.estimated_finish: int | None = None
        self.on_evals = False  # the forecast fits the eval curve (evals only grow): steps no longer refit

    def _curve(self) -> dict[int, dict[str, float]]:
        with self.sessions.begin() as s:
            return job_evidence.curve(s, self.job_id)

    def after_step(self, step: int, estimated_finish: int | None) -> bool:
        """Refit when due; False if the lease is lost."""
        self.estimated_finish = estimated_finish
        if self.on_evals or step % self.refit_every:
            return True
        curve = self._curve()
        if self._fits_evals(curve):
            return True  # the eval curve only changes at an eval (after_eval refits)
        return self.refit(curve, step)

    def _fits_evals(self, curve: dict[int, dict[str, float]]) -> bool:
        self.on_evals = self.on_evals or sum("eval_reward_mean" in m for m in curve.values()) >= MIN_POINTS
        return self.on_evals

    def after_eval(self, step: int, event) -> bool:
        """Refit, then apply stop_when; `event(message, data=...)` reports a stop. False if the lease is lost."""
        curve = self._curve()
        self._fits_evals(curve)
        if self.stop_when is not None and 0 < step < self.total_steps and self.stop_reason is None:
            reason = stop_reason(eval_points(curve), target=self.stop_when.target,
                                 plateau_evals=self.stop_when.plateau.evals if self.stop_when.plateau else None)
            if reason is not None:
                self.stop_reason = reason
                event(f"Stopping early at step {step} of {self.total_steps} (training.stop_when): {reason}",
                      data={"step": step, "stop_reason": reason})
        return self.refit(curve, step)

    def refit(self, curve: dict[int, dict[str, float]], step: int) -> bool:
        source, compute, reward, tokens, last = curve_points(curve)
        try:
            # The last step's compute, at the tokens per step so far.
            final = tokens / last * self.total_steps if last else 0.0
            result = {**forecast(compute, reward, final), "source": source, "fitted_at_step": step,
                      "final_step": self.total_steps, "final_compute": final,
                      "estimated_finish": self.estimated_finish}
        except Exception:  # noqa: BLE001 - a forecast is advice: it never fails the job (e.g. no compute yet)
            log.warning("job %s: forecast at step %d failed", self.job_id, step, exc_info=True)
            return True
        with self.sessions.begin() as s:
            return job_evidence.set_forecast(s, self.job_id, self.epoch, _finite(result))

    def spared_checkpoint(self, s: Session) -> str | None:
        """The checkpoint the retention must keep (training.keep_best), before it prunes."""
        if not self.keep_best:
            return None
        best = job_evidence.best_checkpoint(s, self.job_id)
        return best.id if best is not None else None

    def name_best(self, s: Session) -> None:
        """After pruning: name the best kept checkpoint on the job."""
        best = job_evidence.best_checkpoint(s, self.job_id)
        job_evidence.set_best_checkpoint(s, self.job_id, self.epoch, best.id if best is not None else None)
