"""Reports one run of a service job: heartbeats, step metrics and events, checkpoints, samples, warnings.

Every write is fenced by the run's lease epoch; a write the fence refuses marks the run as lost
(`lost`), and the trainer stops at its next step boundary (`should_stop`).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.job_spec.spec import TrainingSpec
from service.repositories import job_lease, job_outputs, job_records, jobs
from service.settings import Settings
from service.storage import ObjectStore, StorageError
from worker.checkpoints.artifacts import upload_checkpoint
from worker.jobs.drain import DRAIN
from worker.jobs.heartbeat import Heartbeat
from worker.jobs.job_evidence import JobEvidence
from worker.jobs.progress import StepClock
from worker.rewards.errors import summarize
from service.sandbox.channel import INTERRUPT
from worker.trainer.learning_signal import no_signal_message, preflight_message

log = logging.getLogger(__name__)

# Metrics worth a line in the job's event stream (all of them go to the metrics table).
EVENT_METRICS = ("reward_mean", "loss", "clip_fraction", "kl_old", "completion_length_mean", "step_seconds",
                 "policy_lag_max", "stale_dropped")  # the last two only with asynchronous rollouts
REWARD_WARN_EVERY = 10  # steps between warn events that repeat already-shown reward errors


def _finite(metrics: dict) -> dict[str, float]:
    """JSON and SQL cannot hold NaN everywhere; a non-finite metric is left out rather than stored."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class JobReporter:
    """Trainer callbacks that write to SQL (fenced) and the object store, and relay control requests."""

    interrupts_on_cancel = True  # a cancel also stops the process's user code mid-batch (one job per process)

    def __init__(self, sessions: sessionmaker[Session], store: ObjectStore, job_id: str, epoch: int,
                 settings: Settings, total_steps: int, keep_checkpoints: int = 3, environment: str | None = None,
                 export_merged: tuple[str, str] | None = None, training: TrainingSpec | None = None):
        """`environment`: the job's environment, described (its failures are reported as its own, not a reward's);
        `export_merged`: (base model, spec dtype) when each checkpoint is also to be stored merged into its base;
        `training`: the job's training section (its stop_when and keep_best: worker/jobs/job_evidence.py)."""
        self.export_merged = export_merged
        self.sessions, self.store, self.job_id, self.epoch = sessions, store, job_id, epoch
        self.environment = environment
        self.settings, self.total_steps = settings, total_steps
        self.keep_checkpoints = keep_checkpoints
        self.cancel = self.pause = self.lost = False
        self._reward_errors_seen: set[str] = set()  # messages already shown in a warn event
        self._reward_warned_at: int | None = None
        self._clock = StepClock(total_steps)
        self.evidence = JobEvidence(sessions, job_id, epoch, total_steps, training)  # forecast, early stop, best
        self.trackers = None  # the job's experiment trackers (worker/tracking/trackers.py), set by the job runner
        self._beat = Heartbeat(self.heartbeat, settings.heartbeat_s, name=f"heartbeat-{job_id}")

    # -- lease ---------------------------------------------------------------

    def start(self) -> None:
        self._beat.start()

    def stop(self) -> None:
        self._beat.stop()

    def heartbeat(self) -> None:
        with self.sessions.begin() as s:
            control = job_lease.heartbeat(s, self.job_id, self.epoch, self.settings.lease_ttl_s)
        if control is None:
            self.lost = True
        else:
            self.cancel, self.pause = control.cancel, control.pause
            # A cancelled job has no step worth finishing (pause and drain keep theirs): its user code is cut short.
            if self.cancel and self.interrupts_on_cancel:
                INTERRUPT.set()

    def event(self, message: str, *, level: str = "info", type: str = "message", data: dict | None = None) -> None:
        if self.lost:
            return
        with self.sessions.begin() as s:
            jobs.add_event(s, self.job_id, message, level=level, type=type, data=data)

    # -- trainer callbacks ---------------------------------------------------

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        finite = _finite(metrics)
        with self.sessions.begin() as s:
            ok = job_records.record_step(s, self.job_id, self.epoch, step, finite,
                                         trained_tokens=int(metrics.get("trained_tokens", 0)),
                                         ttl_s=self.settings.lease_ttl_s)
            if not ok:
                self.lost = True
                return
            summary = ", ".join(f"{k}={finite[k]:.4g}" for k in EVENT_METRICS if k in finite)
            jobs.add_event(s, self.job_id, f"Step {step}/{self.total_steps}: {summary}", type="metrics",
                           data={"step": step, "total_steps": self.total_steps, **finite})
            eta = self._clock.estimate(time.time(), step, finite.get("step_seconds", 0.0))
            job_outputs.set_estimated_finish(s, self.job_id, self.epoch, eta)
        self._track(step, finite)
        if not self.evidence.after_step(step, eta):
            self.lost = True
        self.heartbeat()

    def _track(self, step: int, metrics: dict[str, float]) -> None:
        if self.trackers is not None and metrics:
            self.trackers.log(step, metrics)  # never raises: a broken tracker is switched off

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        metrics = _finite(metrics)
        with self.sessions.begin() as s:
            if not job_records.record_step(s, self.job_id, self.epoch, step, metrics, trained_tokens=0,
                                           ttl_s=self.settings.lease_ttl_s):
                self.lost = True
                return
            jobs.add_event(s, self.job_id, f"Evaluation at step {step}: reward {metrics.get('eval_reward_mean', float('nan')):.4f}",
                           type="metrics", data={"step": step, **metrics})
        self._track(step, metrics)
        if not self.evidence.after_eval(step, self.event):
            self.lost = True

    def on_preflight(self, metrics: dict[str, float]) -> None:
        """The pre-flight's baseline: metrics at step 0 and an event (a warning when no group has a signal)."""
        metrics = _finite(metrics)
        with self.sessions.begin() as s:
            if not job_records.record_step(s, self.job_id, self.epoch, 0, metrics, trained_tokens=0,
                                           ttl_s=self.settings.lease_ttl_s):
                self.lost = True
                return
            none = metrics.get("preflight_zero_variance_fraction", 0.0) >= 1.0
            jobs.add_event(s, self.job_id, preflight_message(metrics), level="warn" if none else "info",
                           data={"step": 0, **metrics})
        self._track(0, metrics)

    def on_no_signal(self, step: int, steps: int) -> None:
        self.event(no_signal_message(step, steps), level="warn", data={"step": step, "zero_variance_steps": steps})

    def on_warning(self, step: int, message: str) -> None:
        self.event(f"Step {step}: {message}", level="warn", data={"step": step})

    def on_samples(self, step: int, samples: list[dict]) -> None:
        if self.lost or not samples:
            return
        with self.sessions.begin() as s:
            if not job_outputs.add_samples(s, self.job_id, self.epoch, step, samples):
                self.lost = True

    def on_checkpoint(self, step: int, path: Path) -> None:
        if self.lost:
            return
        prefix, files = upload_checkpoint(self.store, self.job_id, self.epoch, path)
        if self.export_merged is not None:
            files.update(self._merged(step, prefix, path))
        with self.sessions.begin() as s:
            metrics = {m.name: m.value for m in jobs.metrics(s, self.job_id, names=None, step_min=step,
                                                             step_max=step, limit=1000)}
            ckpt = job_records.add_checkpoint(s, self.job_id, self.epoch, step=step, storage_prefix=prefix,
                                              files=files, metrics=metrics, ttl_s=self.settings.lease_ttl_s)
            if ckpt is None:
                self.lost = True
                return
            jobs.add_event(s, self.job_id, f"Checkpoint saved at step {step}", data={"checkpoint": ckpt.id, "step": step})
            dropped = job_records.prune_checkpoints(s, self.job_id, self.epoch, self.keep_checkpoints,
                                                    spare=self.evidence.spared_checkpoint(s))
            self.evidence.name_best(s)
        for old in dropped:  # after commit: no row points at them any more
            try:
                self.store.delete_prefix(old)
            except StorageError:  # only space is lost; the next pass does not retry it
                log.warning("job %s: could not delete the old checkpoint %s", self.job_id, old, exc_info=True)

    def _merged(self, step: int, prefix: str, path: Path) -> dict:
        """The merged model's stored files; none (and an error event) when the merge fails: the checkpoint, the
        job's progress, is kept either way."""
        from worker.model.export import export_merged  # torch and transformers load here, not at worker import

        try:
            return export_merged(self.store, prefix, *self.export_merged, path)
        except StorageError:
            raise  # an outage: the run stops and resumes like any other upload failure
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for a second copy of the base
            log.exception("job %s: merging the step %d checkpoint failed", self.job_id, step)
            self.event(f"Could not merge the step {step} checkpoint into the base model ({type(e).__name__}: "
                       f"{str(e)[:300]}); the checkpoint is kept with its adapter only", level="error",
                       data={"step": step})
            return {}

    def on_reward_errors(self, step: int, errors: list[str]) -> None:
        """A warn event with the step's most frequent reward errors (up to 5 distinct, truncated) and counts.

        A reward that fails a little on every step would otherwise add a warn event per step: a step whose
        errors were all shown already gets one only every REWARD_WARN_EVERY steps (every step's count is
        in the reward_errors metric).
        """
        if self.lost or not errors:
            return
        top = summarize(errors, limit=5)
        new = {m for m, _ in top} - self._reward_errors_seen
        if not new and self._reward_warned_at is not None and step - self._reward_warned_at < REWARD_WARN_EVERY:
            return
        self._reward_errors_seen |= new
        self._reward_warned_at = step
        listed = "; ".join(f"{message} (x{count})" for message, count in top)
        more = len({*errors}) - len(top)
        tail = f"; and {more} other distinct errors" if more > 0 else ""
        what = f"Environment errors at step {step} ({self.environment}): {len(errors)} episodes failed" \
            if self.environment else f"Reward errors at step {step}: {len(errors)} samples failed to score"
        self.event(f"{what}: {listed}{tail}",
                   level="warn", data={"step": step, "reward_errors": len(errors),
                                       "errors": [{"message": m, "count": c} for m, c in top]})

    def should_stop(self) -> bool:
        return self.cancel or self.pause or self.lost or DRAIN.is_set() or self.evidence.stop_reason is not None
