"""Repairs what the broker cannot: jobs whose worker died are put back in the queue.

Celery on Redis can lose a message (a killed worker, a Redis restart) and
redelivers late. The SQL lease is the truth: a running job whose lease
expired has no live worker, so it is re-queued from SQL and re-enqueued.
"""

from __future__ import annotations

import logging
import threading

from service.db.session import session_factory
from service.queue import enqueue_job
from service.repositories import jobs
from service.settings import Settings

log = logging.getLogger(__name__)


def reconcile_once(settings: Settings) -> list[str]:
    with session_factory(settings.resolved_database_url()).begin() as s:
        requeued = jobs.requeue_expired(s)
    for job_id in requeued:  # after commit, as every enqueue
        enqueue_job(job_id)
        log.warning("job %s: lease expired; re-queued", job_id)
    return requeued


def start(settings: Settings, interval_s: float = 30.0) -> threading.Event:
    """Run reconcile_once every interval in a daemon thread; set the returned event to stop."""
    stop = threading.Event()

    def loop():
        while not stop.wait(interval_s):
            try:
                reconcile_once(settings)
            except Exception:
                log.exception("reconciler pass failed")

    threading.Thread(target=loop, name="reconciler", daemon=True).start()
    return stop
