"""How a job's run ends: the outcome of a run that returned, the record of it (fenced by the lease epoch), the
job's next run queued when it is to run again, its trackers closed, its scratch directory and uncommitted
uploads removed. A run that lost its lease leaves every SQL row to the job's new owner (`abandon`).

A retryable failure queues the job again after a growing backoff, until it has used `max_attempts` runs; an
outage (the object store, the Ray cluster) is waited out without spending an attempt, up to a deadline."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from service.job_spec.spec import JobSpec
from service.queue import enqueue_job
from service.repositories import job_lease, job_messages, job_records, job_recovery, jobs
from service.settings import Settings
from service.storage import ObjectStore
from service.storage_layout import job_checkpoints, run_checkpoints
from worker import scratch
from worker.checkpoints.artifacts import delete_unreferenced
from worker.jobs.drain import DRAIN
from worker.jobs.job_reporter import JobReporter
from worker.jobs.lifecycle.failures import MESSAGE_CHARS, OUTAGES, Failure, LeaseLost
from worker.jobs.lifecycle.start import Claimed
from worker.jobs.progress import reward_trend
from worker.jobs.results import publish as publish_results

log = logging.getLogger(__name__)


def run_outcome(reporter: JobReporter, steps_done: int, total: int) -> tuple[str, Failure | None]:
    """(status, failure) of a run that returned after `steps_done` steps; raises LeaseLost when it lost its lease."""
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
    return "failed", Failure("training_error", f"the run stopped at step {steps_done} of {total}", False)


def abandon(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed, reporter: JobReporter,
            work: Path) -> None:
    """A run that lost its lease: another worker owns the job now; leave it every SQL row untouched."""
    log.warning("job %s: lease lost; another worker owns it now", job_id)
    if reporter.trackers is not None:  # close this process's handle; the new owner's run logs on to it
        reporter.trackers.finish("lost")
    scratch.remove(work)
    _delete_uncommitted(sessions, store, job_id, run_checkpoints(job_id, claimed.epoch))


def conclude(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed, settings: Settings,
             reporter: JobReporter, work: Path, status: str, error: Failure | None) -> str | None:
    """Record how a run ended (fenced), queue its next run if any, clean up; returns the job's status now."""
    status, delay = _record(sessions, store, job_id, claimed, settings, status, error)
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


def _record(sessions: sessionmaker[Session], store: ObjectStore, job_id: str, claimed: Claimed, settings: Settings,
            status: str, error: Failure | None) -> tuple[str | None, float]:
    """Record how the run ended (fenced); returns (the job's status now, seconds before its next run)."""
    epoch, delay = claimed.epoch, 0.0
    if error and error.code in OUTAGES:  # infrastructure, not the job: no attempt spent, up to a deadline
        with sessions.begin() as s:
            outage_delay = _wait_out_outage(s, job_id, claimed, settings, error.message, OUTAGES[error.code])
        if outage_delay is not None:
            return "queued", outage_delay
    with sessions.begin() as s:
        if error and error.retryable and claimed.attempt < settings.max_attempts:
            delay = job_recovery.retry_delay(claimed.attempt, base_s=settings.retry_backoff_s)
            if not job_lease.requeue(s, job_id, epoch, delay_s=delay):
                return None, 0.0  # the lease was lost meanwhile: the job is another worker's now
            jobs.add_event(s, job_id, f"Attempt {claimed.attempt} of {settings.max_attempts} failed "
                           f"({error.code}: {error.message[:500]}); the job runs again in {delay:.0f} s from its "
                           "newest checkpoint", level="warn")
            return "queued", delay
        if error or status not in ("paused", "queued"):  # a terminal end: the metrics CSV becomes the result file
            try:
                with s.begin_nested():  # a failure here rolls back only this, not the job's end
                    publish_results(s, store, job_id, epoch, claimed.project_id)
            except Exception:  # the job's outcome matters more than its CSV
                log.exception("job %s: could not publish the result file", job_id)
        if error:
            ended = job_lease.finish(s, job_id, epoch, "failed", error_code=error.code,
                                     error_message=error.message[:MESSAGE_CHARS])
            message, status = f"Job failed: {error.message[:500]}", "failed"
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


def _wait_out_outage(s: Session, job_id: str, claimed: Claimed, settings: Settings, message: str,
                     what: str) -> float | None:
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
    """The final event's verdict on the run's rewards (worker/jobs/progress.py), from the recorded step metrics."""
    rows = jobs.metrics(s, job_id, names=["reward_mean", "reward_std"], step_min=1, step_max=None,
                        limit=2 * spec.training.steps)
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(row.step, {})[row.name] = row.value
    steps = [(v["reward_mean"], v.get("reward_std", 0.0)) for _, v in sorted(by_step.items()) if "reward_mean" in v]
    moved, sentence = reward_trend(steps, spec.training.batch_size * spec.training.group_size)
    return {"reward_moved": moved, "reward_trend": sentence}
