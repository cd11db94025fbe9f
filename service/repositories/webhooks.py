"""Webhook endpoints and the delivery outbox."""

from __future__ import annotations

import time

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db.models import Job, WebhookDelivery, WebhookEndpoint, new_id, now
from service.repositories.inserts import insert_ignoring_duplicates
from service.repositories.jobs import TERMINAL
from service.repositories.pagination import Page, paginate


def add(session: Session, endpoint: WebhookEndpoint) -> WebhookEndpoint:
    session.add(endpoint)
    session.flush()
    return endpoint


def get(session: Session, project_id: str, endpoint_id: str) -> WebhookEndpoint | None:
    return session.scalar(select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id,
                                                        WebhookEndpoint.id == endpoint_id))


def page(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[WebhookEndpoint]:
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id)
    return paginate(session, stmt, WebhookEndpoint, after=after, limit=limit)


def delete(session: Session, endpoint: WebhookEndpoint) -> None:
    session.delete(endpoint)
    session.flush()


def deliveries(session: Session, endpoint_id: str, *, after: str | None, limit: int) -> Page[WebhookDelivery]:
    stmt = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
    return paginate(session, stmt, WebhookDelivery, after=after, limit=limit)


# -- the outbox ----------------------------------------------------------------


# A job stays on the outbox's work list this long after it ended, re-read by each pass (harmlessly: the
# unique (endpoint, job) pair ignores a repeat), so an endpoint whose registration commits a moment after
# the job ended, or whose clock runs a little behind the worker's, still gets it.
SETTLE_S = 60


def enqueue_outcomes(session: Session, event_type: dict[str, str], *, limit: int = 500) -> int:
    """Add a delivery for every job that ended (after its endpoint was registered) and has none yet.

    The outcomes come from the job rows themselves, so every way a job can end (worker, API cancel,
    attempts used up) is seen, and a crash between a job's end and this pass loses nothing. A job
    leaves the work list (webhooks_enqueued_at) in the same transaction that adds its deliveries,
    once settled, so each pass reads only recently ended jobs, through a partial index. Oldest first,
    `limit` at a time: a backlog (the first pass after the upgrade) drains over a few passes.
    """
    # finished_at is set exactly when a job ends; status is checked here, not in SQL, so that no planner
    # (SQLite has no statistics) prefers the status index, which holds every job that ever ended.
    ended = [job for job in session.execute(
        select(Job.id, Job.project_id, Job.status, Job.finished_at)
        .where(Job.webhooks_enqueued_at.is_(None), Job.finished_at.is_not(None))
        .order_by(Job.finished_at).limit(limit)) if job.status in TERMINAL]
    if not ended:
        return 0
    endpoints: dict[str, list] = {}
    for endpoint in session.execute(select(WebhookEndpoint.id, WebhookEndpoint.project_id, WebhookEndpoint.events,
                                           WebhookEndpoint.created_at)
                                    .where(WebhookEndpoint.project_id.in_({job.project_id for job in ended}))):
        endpoints.setdefault(endpoint.project_id, []).append(endpoint)
    rows = [{"id": new_id("evt_"), "endpoint_id": endpoint.id, "job_id": job.id, "type": event_type[job.status],
             "created_at": job.finished_at, "attempts": 0, "next_attempt_at": time.time()}
            for job in ended for endpoint in endpoints.get(job.project_id, ())
            if job.finished_at >= endpoint.created_at and event_type[job.status] in endpoint.events]
    insert_ignoring_duplicates(session, WebhookDelivery, rows)
    settled = [job.id for job in ended if job.finished_at <= now() - SETTLE_S]
    if settled:
        session.execute(update(Job).where(Job.id.in_(settled)).values(webhooks_enqueued_at=now())
                        .execution_options(synchronize_session=False))
    return len(rows)


def due(session: Session, limit: int) -> list[str]:
    return list(session.scalars(
        select(WebhookDelivery.id).where(WebhookDelivery.delivered_at.is_(None), WebhookDelivery.failed_at.is_(None),
                                         WebhookDelivery.next_attempt_at <= time.time())
        .order_by(WebhookDelivery.next_attempt_at).limit(limit)))


def claim(session: Session, delivery_id: str, hold_s: float) -> tuple[WebhookDelivery, WebhookEndpoint] | None:
    """Take a due delivery for one attempt (compare-and-set, so two senders never send it at once)."""
    t = time.time()
    result = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == delivery_id, WebhookDelivery.delivered_at.is_(None),
               WebhookDelivery.failed_at.is_(None), WebhookDelivery.next_attempt_at <= t)
        .values(next_attempt_at=t + hold_s, attempts=WebhookDelivery.attempts + 1)
        .execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return None
    return session.execute(select(WebhookDelivery, WebhookEndpoint).join(
        WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id).where(
        WebhookDelivery.id == delivery_id)).one()._tuple()


def record(session: Session, delivery_id: str, *, delivered: bool, error: str | None, retry_at: float | None) -> None:
    """An attempt's outcome: delivered, to be retried at retry_at, or (retry_at None) given up."""
    if delivered:
        values = {"delivered_at": now(), "last_error": None}
    elif retry_at is not None:
        values = {"next_attempt_at": retry_at, "last_error": error}
    else:
        values = {"failed_at": now(), "last_error": error}
    session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(**values)
                    .execution_options(synchronize_session=False))
