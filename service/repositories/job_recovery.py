"""Runs that failed or were lost: how long to wait before the next one, and the reconciler's sweeps (leases that
expired, jobs out of attempts, queued jobs whose broker message may be lost)."""

from __future__ import annotations

import time

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from service.db.models import Job, now
from service.repositories import leases
from service.repositories.jobs import add_event


def retry_delay(attempts: int, *, base_s: float, cap_s: float = 360.0) -> float:
    """Exponential backoff before attempt `attempts + 1`: base, 2*base, 4*base, ... capped (as Kubernetes Jobs)."""
    return min(cap_s, base_s * 2 ** max(0, attempts - 1))


def outage_delay(elapsed_s: float, *, base_s: float, cap_s: float = 60.0) -> float:
    """Wait before trying again after an outage has lasted `elapsed_s`: about doubling, and never long once it
    is over (cap_s), since nothing about the job is wrong."""
    return min(cap_s, max(base_s, elapsed_s))


def fail_exhausted(session: Session, job_id: str, max_attempts: int) -> bool:
    """Fail a job that is waiting for a run but has used all its attempts; a live lease is never touched."""
    t = time.time()
    result = session.execute(
        update(Job).where(
            Job.id == job_id, Job.attempts >= max_attempts,
            or_(Job.status == "queued", leases.expired(Job, t)),
        )
        .values(status="failed", error_code="too_many_attempts",
                error_message=f"the job failed {max_attempts} times: its worker crashed or lost its lease "
                              "each time (see the job's events)",
                finished_at=now(), lease_owner=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1:
        add_event(session, job_id, f"Job failed: no attempts left after {max_attempts}", level="error")
    return result.rowcount == 1


def requeue_expired(session: Session, *, max_attempts: int, backoff_s: float) -> list[str]:
    """Queue again (after a backoff) running jobs whose worker stopped heartbeating, or fail those with no
    attempt left; returns the ids queued again."""
    t = time.time()
    expired = list(session.execute(select(Job.id, Job.attempts).where(leases.expired(Job, t))))
    requeued = []
    for job_id, attempts in expired:
        if attempts >= max_attempts:
            fail_exhausted(session, job_id, max_attempts)
            continue
        delay = retry_delay(attempts, base_s=backoff_s)
        result = session.execute(
            update(Job).where(Job.id == job_id, leases.expired(Job, t))
            .values(status="queued", lease_owner=None, lease_expires_at=None, not_before=t + delay)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:
            add_event(session, job_id, f"The worker stopped responding; the job runs again in {delay:.0f} s "
                      f"(attempt {attempts + 1} of {max_attempts})", level="warn")
            requeued.append(job_id)
    return requeued


def queued_before(session: Session, created_before: int) -> list[str]:
    """Queued jobs older than a moment, past any retry backoff: candidates for a lost broker message."""
    t = time.time()
    return list(session.scalars(select(Job.id).where(
        Job.status == "queued", Job.created_at < created_before, or_(Job.not_before.is_(None), Job.not_before <= t))))
