"""Runs one service job: claim the lease, fetch inputs, train, report, end the lease.

The SQL row is the truth. A duplicate broker message finds the lease taken
and returns; a worker that loses its lease stops writing at once (every write
is fenced by the lease epoch, and its checkpoints go under its epoch's own
prefix). Cancellation, pause and the worker's graceful shutdown (DRAIN) are
honoured at the next step boundary, after a checkpoint; the job resumes from
it on this worker or any other. A cancel also cuts short a batch of sandboxed
user code (a reward or environment) at once: nothing of the step is kept.

Failures: a bad job (its data, checkpoint or reward) fails at once. Anything
else (an unreachable object store, a crashed step) may be transient: the job
is queued again after a growing backoff and resumes from its newest
checkpoint, until it has used `max_attempts` runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.db.session import session_factory
from service.models.engine_check import EngineUnsupported
from service.repositories import job_lease, job_messages, job_records, job_recovery, jobs
from service.repositories import secrets as secrets_repo
from service.job_spec.spec import JobSpec
from service.schemas.rewards import secret_names
from service.secrets.box import secret_box
from service.settings import Settings
from service.queue import enqueue_job
from service.storage import NotFound as StorageNotFound
from service.storage import ObjectStore, StorageError, open_store
from service.storage_layout import MANIFEST, job_checkpoints, run_checkpoints
from worker.artifacts import delete_unreferenced, download_checkpoint
from worker.checkpoint import CheckpointError, checkpoint_name
from worker import scratch
from worker.drain import DRAIN  # set by the worker's graceful shutdown (see worker/drain.py)
from worker.envs import describe_environment
from worker.job_reporter import JobReporter, LeaseLost
from worker.model.unfetchable import unfetchable_model
from worker.progress import reward_trend
from worker.ray_driver.errors import RAY_CAPACITY, RayCapacity
from worker.results import publish as publish_results
from worker.rewards.engine import ScoringContext
from worker.rewards.errors import EnvironmentErrorRateExceeded, RewardErrorRateExceeded
from service.sandbox.channel import INTERRUPT, Interrupted
from worker.trackers import Trackers
from worker.trainer.data import DataError
from worker.trainer.learning_signal import NoLearningSignal

log = logging.getLogger(__name__)

STORAGE_UNAVAILABLE = "storage_unavailable"  # the error code of a run stopped by an object-store outage
OUTAGES = {STORAGE_UNAVAILABLE: "The object store is unavailable", RAY_CAPACITY: "The Ray cluster lacks capacity"}


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


@dataclass(frozen=True)
class Claimed:
    """What a run needs from SQL, read under the lease."""

    epoch: int
    attempt: int
    project_id: str
    spec: JobSpec
    latest: tuple[int, str, dict] | None  # newest committed checkpoint: (step, storage prefix, files)
    secrets: dict[str, str]
    start: tuple[str, dict] | None = None  # a continued job's starting checkpoint: (storage prefix, files)


def claim_run(sessions: sessionmaker[Session], job_id: str, owner: str, settings: Settings) -> Claimed | str | None:
    """Take the lease; returns the claim, "failed" if the job has no attempt left, or None if not ours."""
    with sessions.begin() as s:
        job = jobs.get_for_worker(s, job_id)
        if job is None:
            log.warning("job %s does not exist; message dropped", job_id)
            return None
        epoch = job_lease.claim(s, job_id, owner, settings.lease_ttl_s, max_attempts=settings.max_attempts)
        if epoch is None:
            # Someone else holds it, it is waiting out a backoff, it is no longer runnable, or it
            # used up its attempts (then it fails now; a live lease is never touched).
            return "failed" if job_recovery.fail_exhausted(s, job_id, settings.max_attempts) else None
        s.refresh(job)  # the claim changed the row behind the session's back
        spec = JobSpec.model_validate(job.spec)
        latest = jobs.latest_checkpoint(s, job_id)
        latest = (latest.step, latest.storage_prefix, dict(latest.files)) if latest else None
        # Secret values live only in this process's memory, never in the spec, events or errors.
        needed = secret_names(spec.reward) if spec.reward else set()
        if getattr(spec.environment, "auth_secret", None):  # an http environment's auth header
            needed.add(spec.environment.auth_secret)
        secrets = secrets_repo.values(s, job.project_id, needed, secret_box(settings))
        # A service job's init_from is a checkpoint id of its own project (service/models/start.py).
        start = jobs.project_checkpoint(s, job.project_id, spec.init_from) if spec.init_from else None
        start = (start.storage_prefix, dict(start.files)) if start is not None else None
        jobs.add_event(s, job_id, f"Job started (attempt {job.attempts} of {settings.max_attempts}) on {owner}")
    return Claimed(epoch, job.attempts, job.project_id, spec, latest, secrets, start)


def _is_committed(local: Path, latest: tuple[int, str, dict] | None) -> bool:
    """A local checkpoint directory holds exactly the committed one (same manifest, so same files)."""
    if latest is None or local.name != checkpoint_name(latest[0]) or not (local / MANIFEST).is_file():
        return False
    return hashlib.sha256((local / MANIFEST).read_bytes()).hexdigest() == latest[2].get(MANIFEST, {}).get("sha256")


def train(claimed: Claimed, store: ObjectStore, work: Path, settings: Settings, reporter: JobReporter):
    """Run the trainer for the job from its newest committed checkpoint, in this process or across
    spec.resources.gpus processes under torchrun (the lease and heartbeat stay here); returns its TrainResult."""
    from worker.torchrun.launch import run_training  # torch loads here, not at worker import

    local_spec, run_dir = prepare_run(claimed, store, work, reporter)
    scoring = ScoringContext.from_settings(settings, claimed.secrets)
    if local_spec.resources.on_ray:  # larger than one machine: this worker drives it on the Ray cluster
        from worker.ray_driver.entry import run_on_ray_cluster

        return run_on_ray_cluster(local_spec, run_dir, reporter, settings=settings, scoring=scoring)
    return run_training(local_spec, run_dir, reporter, scoring=scoring)


def prepare_run(claimed: Claimed, store: ObjectStore, work: Path, reporter: JobReporter) -> tuple[JobSpec, Path]:
    """The job's data and newest committed checkpoint on local disk: (the spec pointing at them, the run
    directory the trainer resumes in)."""
    reporter.event("Fetching the dataset")
    local_spec = _materialize(claimed.spec, store, scratch.make_run_dir(work) / "data")
    run_dir = work / "run"
    # Only the committed checkpoint may be resumed from: a local one left by a failed or killed run on
    # this machine was never recorded (a final one would then never be uploaded at all).
    for local in (run_dir / "checkpoints").glob("*"):
        if not _is_committed(local, claimed.latest):
            shutil.rmtree(local, ignore_errors=True)
    if claimed.latest is not None:  # resume from the committed checkpoint, wherever it was written
        step, prefix, files = claimed.latest
        download_checkpoint(store, prefix, files, run_dir / "checkpoints" / checkpoint_name(step))
    elif claimed.spec.init_from:  # a continued job's first run: the starting checkpoint, verified when it loads
        if claimed.start is None:
            raise CheckpointError(f"the starting checkpoint {claimed.spec.init_from} no longer exists (its "
                                  "fine-tuned model was deleted)")
        prefix, files = claimed.start
        local = download_checkpoint(store, prefix, files, work / "start" / claimed.spec.init_from)
        local_spec = local_spec.model_copy(update={"init_from": str(local)})
    return local_spec, run_dir


def run_failure(e: Exception) -> tuple[str, str, bool]:
    """(error code, message, whether another attempt may succeed) for an exception out of a run."""
    if isinstance(e, EnvironmentErrorRateExceeded):
        return "environment_error_rate", str(e), False
    if isinstance(e, RewardErrorRateExceeded):
        return "reward_error_rate", str(e), False
    if isinstance(e, NoLearningSignal):
        return "no_learning_signal", str(e), False
    if isinstance(e, EngineUnsupported):
        return "engine_unsupported", str(e), False
    if isinstance(e, (DataError, CheckpointError, ValueError)):
        return "invalid_job", str(e), False
    if unfetchable_model(e):
        return "invalid_job", (f"the model cannot be loaded on this worker: {type(e).__name__}: {str(e)[:500]} "
                               "(name a model the workers have, or an absolute path under an allowed model "
                               "directory; a relative path is read as a hub id)"), False
    if isinstance(e, StorageError):
        return STORAGE_UNAVAILABLE if _is_outage(e) else "storage_error", f"the object store failed: {e}", True
    if isinstance(e, RayCapacity):  # no gang, or a node lost: the cluster's, waited out as an outage
        return RAY_CAPACITY, f"the Ray cluster cannot carry the job now: {e}", True
    return "training_error", f"{type(e).__name__}: {e}", True


def _is_outage(e: StorageError) -> bool:
    """The store could not be used at all (unreachable, timing out, refusing), not a missing object."""
    return not isinstance(e, StorageNotFound)


def _wait_out_outage(s: Session, job_id: str, claimed: Claimed, settings: Settings, message: str,
                     what: str = "The object store is unavailable") -> float | None:
    """Queue the job again after a backoff, giving its attempt back, while the outage is younger than
    settings.outage_deadline_s; returns the delay, or None when the run should count as a failed attempt."""
    since = job_records.note_outage(s, job_id, claimed.epoch)
    waited = time.time() - since if since is not None else None
    if waited is None or waited >= settings.outage_deadline_s:
        return None
    delay = job_recovery.outage_delay(waited, base_s=settings.retry_backoff_s)
    if not job_lease.requeue(s, job_id, claimed.epoch, delay_s=delay, failed=False):
        return None
    jobs.add_event(s, job_id, f"{what} ({message[:300]}); the job runs again in "
                   f"{delay:.0f} s from its newest checkpoint, using no attempt (the outage has lasted "
                   f"{waited:.0f} s; it is waited out for {settings.outage_deadline_s:.0f} s)", level="warn")
    return delay


def run_job(job_id: str, settings: Settings, *, owner: str | None = None) -> str | None:
    """Run the job if its lease can be taken; returns the status it ended in (None if not ours)."""
    sessions = session_factory(settings.resolved_database_url())
    store = open_store(settings.resolved_storage_url())
    owner = owner or f"{socket.gethostname()}:{os.getpid()}"
    claimed = claim_run(sessions, job_id, owner, settings)
    if not isinstance(claimed, Claimed):
        return claimed

    total = claimed.spec.training.steps
    reporter = make_reporter(sessions, store, job_id, claimed, settings)
    work = scratch.run_dir(settings, job_id, claimed.epoch)  # this run's own, removed however it ends
    status, error = "failed", None  # error: (code, message, retryable)
    reporter.start()
    try:
        start_trackers(reporter, job_id, claimed, settings)
        result = train(claimed, store, work, settings, reporter)
        status, error = run_outcome(reporter, result.steps_done, total)
    except LeaseLost:
        abandon(sessions, store, job_id, claimed, reporter, work)
        return None
    except Interrupted:  # the cancel stopped the user code mid-batch
        status = "cancelled"
    except Exception as e:  # the job fails or retries with a message; the worker lives on
        log.exception("job %s: run failed", job_id)
        error = run_failure(e)
    finally:
        reporter.stop()
        INTERRUPT.clear()  # the cancel was this job's: later user code in this process must run
    return conclude(sessions, store, job_id, claimed, settings, reporter, work, status, error)


def make_reporter(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed,
                  settings: Settings, kind: type[JobReporter] = JobReporter) -> JobReporter:
    """The run's fenced reporter (heartbeat, metrics, events, checkpoints), not yet started."""
    spec = claimed.spec
    return kind(sessions, store, job_id, claimed.epoch, settings, spec.training.steps,
                keep_checkpoints=spec.training.checkpoint_keep,
                environment=describe_environment(spec.environment) if spec.environment else None,
                export_merged=(spec.model, spec.dtype) if spec.training.export == "merged" else None,
                training=spec.training)


def start_trackers(reporter: JobReporter, job_id: str, claimed: Claimed, settings: Settings) -> None:
    if claimed.spec.integrations:
        reporter.trackers = Trackers(claimed.spec.integrations, job_id, settings, tracker_config(claimed.spec),
                                     reporter.event, project_id=claimed.project_id)


def run_outcome(reporter: JobReporter, steps_done: int, total: int) -> tuple[str, tuple[str, str, bool] | None]:
    """(status, error) of a run that returned after `steps_done` steps; raises LeaseLost when it lost its lease."""
    if reporter.lost:
        raise LeaseLost()
    if reporter.cancel:
        return "cancelled", None
    if reporter.pause:
        return "paused", None
    if steps_done >= total or reporter.evidence.stop_reason is not None:  # done, or stop_when fired
        return "succeeded", None
    if DRAIN.is_set():
        return "queued", None
    return "failed", ("training_error", f"the run stopped at step {steps_done} of {total}", False)


def abandon(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed, reporter: JobReporter,
            work: Path) -> None:
    """A run that lost its lease: another worker owns the job now; leave it every SQL row untouched."""
    log.warning("job %s: lease lost; another worker owns it now", job_id)
    if reporter.trackers is not None:  # close this process's handle; the new owner's run logs on to it
        reporter.trackers.finish("lost")
    scratch.remove(work)
    _delete_uncommitted(sessions, store, job_id, run_checkpoints(job_id, claimed.epoch))


def conclude(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed, settings: Settings,
             reporter: JobReporter, work: Path, status: str, error: tuple[str, str, bool] | None) -> str | None:
    """Record how a run ended (fenced), queue its next run if any, clean up; returns the job's status now."""
    status, delay = _end(sessions, store, job_id, claimed, settings, status, error)
    if reporter.trackers is not None:
        reporter.trackers.finish(status or "lost")
    if status == "queued":  # after commit, as every enqueue; a lost message is the reconciler's to resend
        try:
            enqueue_job(job_id, delay_s=delay, settings=settings)
        except Exception:
            log.exception("job %s: could not enqueue its next run; the reconciler's next pass will", job_id)
            try:
                with sessions.begin() as s:
                    job_messages.mark_unsent(s, job_id)
            except Exception:  # then its resend of old queued jobs will
                log.exception("job %s: could not mark it as owed a message", job_id)
    scratch.remove(work)  # a later run starts from the committed checkpoint, downloaded
    if status in jobs.TERMINAL:  # no run of the job writes to the store any more
        _delete_uncommitted(sessions, store, job_id, job_checkpoints(job_id))
    return status


def tracker_config(spec: JobSpec) -> dict:
    """What a tracker run records about the job: the knobs people compare runs by."""
    return {"model": spec.model, "seed": spec.seed, "lora": spec.lora.model_dump() if spec.lora else None,
            "steps": spec.training.steps, "batch_size": spec.training.batch_size,
            "group_size": spec.training.group_size, "lr": spec.optimizer.lr, "kl_beta": spec.loss.kl_beta,
            "temperature": spec.sampling.temperature, "max_output_tokens": spec.sampling.max_output_tokens}


def _delete_uncommitted(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, within: str) -> None:
    """Remove checkpoint uploads under `within` that were never committed (only space is at stake)."""
    try:
        with sessions.begin() as s:
            referenced = {c.storage_prefix for c in jobs.checkpoints(s, job_id, after=None, limit=10_000).items}
        for prefix in delete_unreferenced(store, within, referenced):
            log.info("job %s: deleted the uncommitted upload %s", job_id, prefix)
    except Exception:
        log.warning("job %s: could not delete uncommitted uploads under %s", job_id, within, exc_info=True)


def _reward_trend(s: Session, job_id: str, spec: JobSpec) -> dict:
    """The final event's verdict on the run's rewards (worker/progress.py), from the recorded step metrics."""
    rows = jobs.metrics(s, job_id, names=["reward_mean", "reward_std"], step_min=1, step_max=None,
                        limit=2 * spec.training.steps)
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(row.step, {})[row.name] = row.value
    steps = [(v["reward_mean"], v.get("reward_std", 0.0)) for _, v in sorted(by_step.items()) if "reward_mean" in v]
    moved, sentence = reward_trend(steps, spec.training.batch_size * spec.training.group_size)
    return {"reward_moved": moved, "reward_trend": sentence}


def _end(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed, settings: Settings,
         status: str, error: tuple[str, str, bool] | None) -> tuple[str | None, float]:
    """Record how the run ended (fenced); returns (the job's status now, seconds before its next run)."""
    epoch, delay = claimed.epoch, 0.0
    if error and error[0] in OUTAGES:  # infrastructure, not the job: no attempt spent, up to a deadline
        with sessions.begin() as s:
            outage_delay = _wait_out_outage(s, job_id, claimed, settings, error[1], OUTAGES[error[0]])
        if outage_delay is not None:
            return "queued", outage_delay
    with sessions.begin() as s:
        if error and error[2] and claimed.attempt < settings.max_attempts:
            delay = job_recovery.retry_delay(claimed.attempt, base_s=settings.retry_backoff_s)
            if not job_lease.requeue(s, job_id, epoch, delay_s=delay):
                return None, 0.0  # the lease was lost meanwhile: the job is another worker's now
            jobs.add_event(s, job_id, f"Attempt {claimed.attempt} of {settings.max_attempts} failed "
                           f"({error[0]}: {error[1][:500]}); the job runs again in {delay:.0f} s from its "
                           "newest checkpoint", level="warn")
            return "queued", delay
        if error or status not in ("paused", "queued"):  # a terminal end: the metrics CSV becomes the result file
            try:
                with s.begin_nested():  # a failure here rolls back only this, not the job's end
                    publish_results(s, store, job_id, epoch, claimed.project_id)
            except Exception:  # the job's outcome matters more than its CSV
                log.exception("job %s: could not publish the result file", job_id)
        if error:
            ended = job_lease.finish(s, job_id, epoch, "failed", error_code=error[0], error_message=error[1][:2000])
            message, status = f"Job failed: {error[1][:500]}", "failed"
        elif status == "queued":
            ended = job_lease.requeue(s, job_id, epoch, failed=False)
            message = "The worker is shutting down; the job is queued again from its newest checkpoint"
        else:
            ended = job_lease.finish(s, job_id, epoch, status)
            message = {"succeeded": "Job succeeded", "cancelled": "Job cancelled", "paused": "Job paused"}[status]
        data = _reward_trend(s, job_id, claimed.spec) if status == "succeeded" and claimed.spec.method == "cispo" \
            else None
        if data is not None:
            message = f"{message}; {data['reward_trend']}"
        if ended:
            jobs.add_event(s, job_id, message, level="error" if error else "info", data=data)
    return status, delay
