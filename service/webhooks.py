"""Signed webhooks for job outcomes, sent from an outbox with retries (Standard Webhooks style).

A project registers an endpoint (the URL must pass service/egress.py, now
and again at every send) and gets its signing secret once. When one of its
jobs ends, the outbox gets one delivery per endpoint, with OpenAI's event
names (fine_tuning.job.succeeded, .failed, .cancelled) and payload:

    {"object": "event", "id": "evt_...", "type": "fine_tuning.job.succeeded",
     "created_at": 1733000000, "data": {"id": "ftjob-..."}}

Each attempt is a POST with the headers

    webhook-id: evt_...   (the same on every retry: receivers dedupe on it)
    webhook-timestamp: <unix seconds of this attempt>
    webhook-signature: v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>

where key is the base64-decoded part of the secret after "whsec_". A 2xx
answer ends it; anything else (down, timeout, 5xx, 4xx) is retried with
exponential backoff, up to MAX_ATTEMPTS, after which the delivery is marked
failed. Nothing is lost while the receiver is down: the outbox is SQL, and
the deliveries are derived from the job rows (repositories/webhooks.py).
A pass reads only work still to do, through partial indexes: jobs not yet
made into deliveries and deliveries neither delivered nor given up, never
the history of finished jobs.
No database connection is held while a request is in flight.
Hand-written on purpose: signing is four lines of hmac (the `standardwebhooks` package adds a dependency
for them), and the retries are rows of the SQL outbox, which an in-memory retry library could not survive.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.db.models import WebhookDelivery, WebhookEndpoint
from service.egress import EgressPolicy, EgressRefused, check_url, post_bytes
from service.errors import InvalidRequest, NotFound
from service.repositories import webhooks as repo

log = logging.getLogger(__name__)

EVENT_TYPES = {"succeeded": "fine_tuning.job.succeeded", "failed": "fine_tuning.job.failed",
               "cancelled": "fine_tuning.job.cancelled"}
MAX_ATTEMPTS = 16
HOLD_S = 60.0  # a claimed attempt is not retried by another sender for this long


@dataclass(frozen=True)
class Backoff:
    base_s: float = 5.0
    cap_s: float = 3600.0

    def delay(self, attempts: int) -> float:
        """Seconds before the next try after `attempts` failed ones: base, 2 base, 4 base, ... up to cap."""
        return min(self.base_s * 2 ** (attempts - 1), self.cap_s)


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The webhook-signature header value for one attempt."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def payload(delivery: WebhookDelivery) -> bytes:
    return json.dumps({"object": "event", "id": delivery.id, "type": delivery.type,
                       "created_at": delivery.created_at, "data": {"id": delivery.job_id}},
                      separators=(",", ":")).encode()


# -- API side ------------------------------------------------------------------


def register(session: Session, project_id: str, url: str, events: list[str], policy: EgressPolicy) -> WebhookEndpoint:
    try:
        check_url(url, policy)
    except EgressRefused as e:
        raise InvalidRequest(f"url: {e}", param="url") from None
    return repo.add(session, WebhookEndpoint(project_id=project_id, url=url, secret=new_secret(), events=events))


def get(session: Session, project_id: str, endpoint_id: str) -> WebhookEndpoint:
    endpoint = repo.get(session, project_id, endpoint_id)
    if endpoint is None:
        raise NotFound(f"no such webhook endpoint: {endpoint_id}", param="webhook_endpoint_id")
    return endpoint


# -- the sender ----------------------------------------------------------------


def _attempt(delivery: WebhookDelivery, endpoint: WebhookEndpoint, policy: EgressPolicy) -> str | None:
    """Send once; None when the receiver took it (2xx), else what went wrong."""
    body = payload(delivery)
    timestamp = int(time.time())
    headers = {"content-type": "application/json", "webhook-id": delivery.id,
               "webhook-timestamp": str(timestamp), "webhook-signature": sign(endpoint.secret, delivery.id,
                                                                              timestamp, body)}
    try:
        status = post_bytes(check_url(endpoint.url, policy), body, policy, headers=headers)
    except EgressRefused as e:
        return str(e)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"[:500]
    return None if 200 <= status < 300 else f"HTTP {status}"


def dispatch_once(sessions: sessionmaker[Session], policy: EgressPolicy, *, backoff: Backoff = Backoff(),
                  limit: int = 100) -> int:
    """Add deliveries for jobs that ended, then make one attempt at each due one; returns how many arrived."""
    with sessions.begin() as s:
        repo.enqueue_outcomes(s, EVENT_TYPES)
        due = repo.due(s, limit)
    delivered = 0
    for delivery_id in due:
        with sessions.begin() as s:
            claimed = repo.claim(s, delivery_id, HOLD_S)
        if claimed is None:
            continue  # another sender has it
        delivery, endpoint = claimed
        error = _attempt(delivery, endpoint, policy)  # no connection is held while the receiver answers
        retry_at = None
        if error is not None and delivery.attempts < MAX_ATTEMPTS:
            retry_at = time.time() + backoff.delay(delivery.attempts)
        with sessions.begin() as s:
            repo.record(s, delivery_id, delivered=error is None, error=error, retry_at=retry_at)
        if error is None:
            delivered += 1
        else:
            log.warning("webhook %s to %s: attempt %d failed: %s", delivery.id, endpoint.url, delivery.attempts, error)
    return delivered
