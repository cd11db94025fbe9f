"""Webhook endpoints and the delivery outbox."""

from __future__ import annotations

import time

from sqlalchemy import and_, exists, select, update
from sqlalchemy.orm import Session

from service.db.models import Job, WebhookDelivery, WebhookEndpoint, new_id, now
from service.repositories.jobs import TERMINAL, _insert_ignoring_duplicates
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


def enqueue_outcomes(session: Session, event_type: dict[str, str]) -> int:
    """Add a delivery for every job that ended (after its endpoint was registered) and has none yet.

    The outcomes come from the job rows themselves, so every way a job can end (worker, API cancel,
    attempts used up) is seen, and a crash between a job's end and this pass loses nothing. The
    unique (endpoint, job) pair makes a racing second pass harmless.
    """
    ended = select(WebhookEndpoint.id, WebhookEndpoint.events, Job.id, Job.status, Job.finished_at).join(
        Job, and_(Job.project_id == WebhookEndpoint.project_id, Job.status.in_(TERMINAL),
                  Job.finished_at >= WebhookEndpoint.created_at)
    ).where(~exists().where(WebhookDelivery.endpoint_id == WebhookEndpoint.id, WebhookDelivery.job_id == Job.id))
    rows = []
    for endpoint_id, events, job_id, status, finished_at in session.execute(ended):
        if event_type[status] in events:
            rows.append({"id": new_id("evt_"), "endpoint_id": endpoint_id, "job_id": job_id,
                         "type": event_type[status], "created_at": finished_at, "attempts": 0,
                         "next_attempt_at": time.time()})
    _insert_ignoring_duplicates(session, WebhookDelivery, rows)
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
