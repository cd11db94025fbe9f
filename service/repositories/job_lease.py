"""The worker's lease on a job: claiming it, renewing it, and ending the run (finish, requeue).

A claim is a compare-and-set UPDATE that bumps the lease epoch; every later write of that run is fenced by the
epoch (`fenced`), so a worker that lost its lease (paused past its TTL, partitioned) has each write refused,
and stops. A run uses up one of `max_attempts` when it is claimed; a pause or a graceful shutdown gives it
back, so only crashes and failures count. The states: service/repositories/jobs.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from service.db.models import Job, now
from service.repositories import job_history, leases
from service.repositories.jobs import TERMINAL


@dataclass(frozen=True)
class Control:
    """What the API has asked of a running job."""

    cancel: bool
    pause: bool


def fenced(job_id: str, epoch: int):
    """The WHERE clause of every write a run makes: its job, still running, under the run's lease epoch."""
    return and_(Job.id == job_id, Job.lease_epoch == epoch, Job.status == "running")


def _runnable(t: float, max_attempts: int):
    """A queued job past its backoff, or a running one whose worker stopped renewing; with an attempt left."""
    return and_(
        Job.attempts < max_attempts,
        or_(and_(Job.status == "queued", or_(Job.not_before.is_(None), Job.not_before <= t)), leases.expired(Job, t)),
    )


def claim(session: Session, job_id: str, owner: str, ttl_s: float, *, max_attempts: int = 3) -> int | None:
    """Take the lease on a runnable job (see _runnable); returns the epoch. The run uses up an attempt.

    What an earlier run recorded after the newest committed checkpoint is forgotten: this run does those
    steps again (service/repositories/job_history.py)."""
    t = time.time()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, _runnable(t, max_attempts))
        .values(status="running", lease_owner=owner, lease_epoch=Job.lease_epoch + 1,
                lease_expires_at=t + ttl_s, attempts=Job.attempts + 1, not_before=None, enqueue_failed_at=None,
                started_at=func.coalesce(Job.started_at, int(t)))
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    job_history.rewind(session, job_id)
    return session.scalar(select(Job.lease_epoch).where(Job.id == job_id))


def heartbeat(session: Session, job_id: str, epoch: int, ttl_s: float) -> Control | None:
    """Renew the lease; None means it is lost and the worker must stop writing."""
    if not leases.renew(session, Job, fenced(job_id, epoch), ttl_s):
        return None
    cancel, pause = session.execute(
        select(Job.cancel_requested, Job.pause_requested).where(Job.id == job_id)
    ).one()
    return Control(cancel=bool(cancel), pause=bool(pause))


def finish(session: Session, job_id: str, epoch: int, status: str, *, error_code: str | None = None,
           error_message: str | None = None, error_param: str | None = None) -> bool:
    """End the lease with a terminal status or `paused`. A pause gives the run's attempt back: it did not fail."""
    values: dict = {"status": status, "lease_owner": None, "lease_expires_at": None,
                    "cancel_requested": False, "pause_requested": False}
    if status in TERMINAL:
        values["finished_at"] = now()
    if status == "paused":
        values["attempts"] = Job.attempts - 1
    if error_code is not None:
        values.update(error_code=error_code, error_message=error_message, error_param=error_param)
    result = session.execute(
        update(Job).where(fenced(job_id, epoch)).values(**values).execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def requeue(session: Session, job_id: str, epoch: int, *, delay_s: float = 0.0, failed: bool = True) -> bool:
    """End the lease and queue the job again (fenced). A failed run keeps its attempt and waits `delay_s`;
    one stopped by its worker's graceful shutdown (failed=False) gives the attempt back."""
    values: dict = {"status": "queued", "lease_owner": None, "lease_expires_at": None,
                    "not_before": time.time() + delay_s if delay_s > 0 else None}
    if not failed:
        values["attempts"] = Job.attempts - 1
    result = session.execute(
        update(Job).where(fenced(job_id, epoch)).values(**values).execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def running_epochs(session: Session, job_ids: list[str]) -> dict[str, int]:
    """The lease epoch of each of `job_ids` that is running now: the runs that own their job (the scratch sweep
    keeps their directories)."""
    if not job_ids:
        return {}
    return dict(session.execute(select(Job.id, Job.lease_epoch).where(Job.id.in_(job_ids),
                                                                      Job.status == "running")).all())
