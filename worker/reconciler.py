"""Repairs what the broker cannot: jobs whose worker died, and jobs whose message was lost.

Celery on Redis can lose a message (a killed worker, a Redis restart, a
broker that was down when the API enqueued) and redelivers late. The SQL
row is the truth: a running job whose lease expired has no live worker, so
it is re-queued after a backoff (or failed, once it used up its attempts); a
job queued for longer than `resend_after_s` is sent again (a duplicate
message is harmless: the lease admits one runner).
"""

from __future__ import annotations

import logging
import threading
import time

from service.db.session import session_factory
from service.queue import enqueue_job
from service.repositories import jobs
from service.settings import Settings

log = logging.getLogger(__name__)


def reconcile_once(settings: Settings, *, resend_after_s: float = 300.0, sent: dict[str, float] | None = None) -> list[str]:
    """One pass; returns the ids sent to the broker. `sent` remembers when each id was last resent."""
    sent = {} if sent is None else sent
    t = time.time()
    with session_factory(settings.resolved_database_url()).begin() as s:
        requeued = jobs.requeue_expired(s, max_attempts=settings.max_attempts, backoff_s=settings.retry_backoff_s)
        waiting = jobs.queued_before(s, int(t - resend_after_s))
        due = {j: jobs.get_for_worker(s, j).not_before or t for j in requeued}
    for job_id in requeued:
        log.warning("job %s: lease expired; re-queued", job_id)
    resend = requeued + [j for j in waiting if j not in requeued and t - sent.get(j, 0.0) > resend_after_s]
    for job_id in resend:  # after commit, as every enqueue; a re-queued job after its backoff
        enqueue_job(job_id, max(0.0, due.get(job_id, t) - t), settings)
        sent[job_id] = t
    return resend


def start(settings: Settings, interval_s: float = 30.0) -> threading.Event:
    """Run reconcile_once every interval in a daemon thread; set the returned event to stop."""
    stop = threading.Event()
    sent: dict[str, float] = {}

    def loop():
        while not stop.wait(interval_s):
            try:
                reconcile_once(settings, sent=sent)
            except Exception:
                log.exception("reconciler pass failed")

    threading.Thread(target=loop, name="reconciler", daemon=True).start()
    return stop
