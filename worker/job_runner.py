"""Runs one service job: claim the lease, fetch inputs, train, report, end the lease.

The SQL row is the truth. A duplicate broker message finds the lease taken
and returns; a worker that loses its lease stops writing at once (every write
is fenced by the lease epoch). Cancellation and pause are honoured at the
next step boundary; a paused job keeps its checkpoint in the object store and
resumes from it, on this worker or any other.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import threading
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.db.session import session_factory
from service.repositories import jobs
from service.repositories import secrets as secrets_repo
from service.schemas.job_spec import JobSpec
from service.schemas.rewards import secret_names
from service.secret_box import secret_box
from service.settings import Settings
from service.storage import ObjectStore, open_store
from worker.artifacts import download_checkpoint, upload_checkpoint
from worker.checkpoint import CheckpointError, checkpoint_name
from worker.rewards.engine import ScoringContext
from worker.rewards.errors import RewardErrorRateExceeded, summarize
from worker.trainer.data import DataError

log = logging.getLogger(__name__)

# Metrics worth a line in the job's event stream (all of them go to the metrics table).
EVENT_METRICS = ("reward_mean", "loss", "clip_fraction", "kl_old", "completion_length_mean", "step_seconds")
REWARD_WARN_EVERY = 10  # steps between warn events that repeat already-shown reward errors


class LeaseLost(Exception):
    pass


def _finite(metrics: dict) -> dict[str, float]:
    """JSON and SQL cannot hold NaN everywhere; a non-finite metric is left out rather than stored."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class JobReporter:
    """Trainer callbacks that write to SQL (fenced) and the object store, and relay control requests."""

    def __init__(self, sessions: sessionmaker[Session], store: ObjectStore, job_id: str, epoch: int,
                 settings: Settings, total_steps: int):
        self.sessions, self.store, self.job_id, self.epoch = sessions, store, job_id, epoch
        self.settings, self.total_steps = settings, total_steps
        self.cancel = self.pause = self.lost = False
        self._reward_errors_seen: set[str] = set()  # messages already shown in a warn event
        self._reward_warned_at: int | None = None
        self._stop_beat = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{job_id}", daemon=True)

    # -- lease ---------------------------------------------------------------

    def start(self) -> None:
        self._beat.start()

    def stop(self) -> None:
        self._stop_beat.set()
        self._beat.join(timeout=5)

    def _heartbeat_loop(self) -> None:
        while not self._stop_beat.wait(self.settings.heartbeat_s):
            try:
                self.heartbeat()
            except Exception:  # a transient database error: the next beat retries
                log.exception("heartbeat for %s failed", self.job_id)

    def heartbeat(self) -> None:
        with self.sessions.begin() as s:
            control = jobs.heartbeat(s, self.job_id, self.epoch, self.settings.lease_ttl_s)
        if control is None:
            self.lost = True
        else:
            self.cancel, self.pause = control.cancel, control.pause

    def event(self, message: str, *, level: str = "info", type: str = "message", data: dict | None = None) -> None:
        if self.lost:
            return
        with self.sessions.begin() as s:
            jobs.add_event(s, self.job_id, message, level=level, type=type, data=data)

    # -- trainer callbacks ---------------------------------------------------

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        finite = _finite(metrics)
        with self.sessions.begin() as s:
            ok = jobs.record_step(s, self.job_id, self.epoch, step, finite,
                                  trained_tokens=int(metrics.get("trained_tokens", 0)),
                                  ttl_s=self.settings.lease_ttl_s)
            if not ok:
                self.lost = True
                return
            summary = ", ".join(f"{k}={finite[k]:.4g}" for k in EVENT_METRICS if k in finite)
            jobs.add_event(s, self.job_id, f"Step {step}/{self.total_steps}: {summary}", type="metrics",
                           data={"step": step, "total_steps": self.total_steps, **finite})
        self.heartbeat()

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        metrics = _finite(metrics)
        with self.sessions.begin() as s:
            if not jobs.record_step(s, self.job_id, self.epoch, step, metrics, trained_tokens=0,
                                    ttl_s=self.settings.lease_ttl_s):
                self.lost = True
                return
            jobs.add_event(s, self.job_id, f"Evaluation at step {step}: reward {metrics.get('eval_reward_mean', float('nan')):.4f}",
                           type="metrics", data={"step": step, **metrics})

    def on_checkpoint(self, step: int, path: Path) -> None:
        if self.lost:
            return
        prefix, files = upload_checkpoint(self.store, self.job_id, path)
        with self.sessions.begin() as s:
            metrics = {m.name: m.value for m in jobs.metrics(s, self.job_id, names=None, step_min=step,
                                                             step_max=step, limit=1000)}
            ckpt = jobs.add_checkpoint(s, self.job_id, self.epoch, step=step, storage_prefix=prefix,
                                       files=files, metrics=metrics)
            if ckpt is None:
                self.lost = True
                return
            jobs.add_event(s, self.job_id, f"Checkpoint saved at step {step}", data={"checkpoint": ckpt.id, "step": step})

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
        self.event(f"Reward errors at step {step}: {len(errors)} samples failed to score: {listed}{tail}",
                   level="warn", data={"step": step, "reward_errors": len(errors),
                                       "errors": [{"message": m, "count": c} for m, c in top]})

    def should_stop(self) -> bool:
        return self.cancel or self.pause or self.lost


def _materialize(spec: JobSpec, store: ObjectStore, data_dir: Path) -> JobSpec:
    """Download the job's dataset files and point the spec at the local copies."""
    data_dir.mkdir(parents=True, exist_ok=True)
    train = data_dir / "train.jsonl"
    store.get_file(f"files/{spec.data.train_file}", train)
    update = {"train_file": str(train)}
    if spec.data.validation_file:
        val = data_dir / "validation.jsonl"
        store.get_file(f"files/{spec.data.validation_file}", val)
        update["validation_file"] = str(val)
    return spec.model_copy(update={"data": spec.data.model_copy(update=update)})


def run_job(job_id: str, settings: Settings, *, owner: str | None = None) -> str | None:
    """Run the job if its lease can be taken; returns the status it ended in (None if not ours)."""
    sessions = session_factory(settings.resolved_database_url())
    store = open_store(settings.resolved_storage_url())
    owner = owner or f"{socket.gethostname()}:{os.getpid()}"
    with sessions.begin() as s:
        job = jobs.get_for_worker(s, job_id)
        if job is None:
            log.warning("job %s does not exist; message dropped", job_id)
            return None
        if job.attempts >= settings.max_attempts and job.status in ("queued", "running"):
            jobs.fail_unclaimed(s, job_id, "too_many_attempts",
                                f"the job was started {job.attempts} times without finishing")
            return "failed"
        epoch = jobs.claim(s, job_id, owner, settings.lease_ttl_s)
        if epoch is None:
            return None  # someone else holds it, or it is no longer runnable
        job = jobs.get_for_worker(s, job_id)
        spec = JobSpec.model_validate(job.spec)
        latest = jobs.latest_checkpoint(s, job_id)
        latest = (latest.step, latest.storage_prefix, dict(latest.files)) if latest else None
        # Secret values live only in this process's memory, never in the spec, events or errors.
        needed = secret_names(spec.reward) if spec.reward else set()
        if getattr(spec.environment, "auth_secret", None):  # an http environment's auth header
            needed.add(spec.environment.auth_secret)
        secrets = secrets_repo.values(s, job.project_id, needed, secret_box(settings))
        jobs.add_event(s, job_id, f"Job started (attempt {job.attempts}) on {owner}")

    reporter = JobReporter(sessions, store, job_id, epoch, settings, spec.training.steps)
    work = settings.resolved_work_dir() / job_id
    status, error = "failed", None
    reporter.start()
    try:
        from worker.trainer.loop import Trainer  # torch loads here, not at worker import

        local_spec = _materialize(spec, store, work / "data")
        run_dir = work / "run"
        if latest is not None:  # resume from the committed checkpoint, wherever it was written
            download_checkpoint(store, latest[1], latest[2], run_dir / "checkpoints" / checkpoint_name(latest[0]))
        trainer = Trainer(local_spec, run_dir, scoring=ScoringContext.from_settings(settings, secrets))
        if trainer.step:
            reporter.event(f"Resumed from the checkpoint at step {trainer.step}")
        result = trainer.run(reporter)
        if reporter.lost:
            raise LeaseLost()
        if reporter.cancel:
            status = "cancelled"
        elif reporter.pause:
            status = "paused"
        elif result.steps_done >= spec.training.steps:
            status = "succeeded"
        else:
            error = ("training_error", f"the run stopped at step {result.steps_done} of {spec.training.steps}")
    except LeaseLost:
        log.warning("job %s: lease lost; another worker owns it now", job_id)
        return None
    except RewardErrorRateExceeded as e:
        error = ("reward_error_rate", str(e))
    except (DataError, CheckpointError, ValueError) as e:
        error = ("invalid_job", str(e))
    except Exception as e:  # the job fails with a message; the worker lives on
        log.exception("job %s failed", job_id)
        error = ("training_error", f"{type(e).__name__}: {e}")
    finally:
        reporter.stop()

    with sessions.begin() as s:
        if error:
            ended = jobs.finish(s, job_id, epoch, "failed", error_code=error[0], error_message=error[1][:2000])
        else:
            ended = jobs.finish(s, job_id, epoch, status)
        if ended:
            message = {"succeeded": "Job succeeded", "cancelled": "Job cancelled", "paused": "Job paused"}.get(
                status if not error else "", f"Job failed: {error[1][:500] if error else 'unknown error'}")
            jobs.add_event(s, job_id, message, level="error" if error else "info")
    if status != "paused":
        shutil.rmtree(work, ignore_errors=True)
    return "failed" if error else status
