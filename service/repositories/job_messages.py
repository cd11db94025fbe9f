"""Broker messages a queued job is owed: an enqueue that failed is marked on the job's row.

The row is committed before its message is sent (a worker must find it), so
a broker that is down or stalled at that moment leaves a queued job nobody
was told about. Marking the failure lets the reconciler send it on its next
pass (seconds) rather than after its resend of old queued jobs (minutes). A
duplicate message is harmless: the lease admits one run.
"""

from __future__ import annotations

import time

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db.models import Job


def mark_unsent(session: Session, job_id: str) -> bool:
    """The job's message could not be sent (keeps the first failure's time)."""
    result = session.execute(update(Job).where(Job.id == job_id, Job.status == "queued",
                                               Job.enqueue_failed_at.is_(None))
                             .values(enqueue_failed_at=time.time()).execution_options(synchronize_session=False))
    return result.rowcount == 1


def unsent(session: Session) -> list[tuple[str, float | None]]:
    """(job id, not before) of queued jobs owed a message."""
    return [(job_id, not_before) for job_id, not_before in session.execute(
        select(Job.id, Job.not_before).where(Job.status == "queued", Job.enqueue_failed_at.is_not(None)))]


def mark_sent(session: Session, job_id: str) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(enqueue_failed_at=None)
                    .execution_options(synchronize_session=False))

