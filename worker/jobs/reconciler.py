"""Repairs what the broker cannot: jobs whose worker died, and jobs whose message was lost.

Celery on Redis can lose a message (a killed worker, a Redis restart, a
broker that was down when the API enqueued) and redelivers late. The SQL
row is the truth: a running job whose lease expired has no live worker, so
it is re-queued after a backoff (or failed, once it used up its attempts); a
job whose enqueue failed (marked on its row, service/repositories/job_messages.py)
is sent on the next pass; and any job queued for longer than `resend_after_s`
is sent again, for a message lost without anyone noticing (a duplicate
message is harmless: the lease admits one runner). Eval runs queued that long
are sent again too (their claim admits one runner); a running eval run whose
lease expired is failed (service/repositories/evals.py says why it is not retried). Tinker sessions whose
heartbeats stopped end, releasing their models, and Tinker requests that ended long ago are deleted
(service/repositories/tinker.py).
"""

from __future__ import annotations

import logging
import threading
import time

from service.db.session import session_factory
from service.queue import enqueue_eval, enqueue_job
from service.repositories import evals, job_messages, job_recovery, jobs, tinker
from service.settings import Settings
from worker import scratch

log = logging.getLogger(__name__)


def reconcile_once(settings: Settings, *, resend_after_s: float = 300.0, sent: dict[str, float] | None = None) -> list[str]:
    """One pass; returns the ids sent to the broker. `sent` remembers when each id was last resent."""
    sent = {} if sent is None else sent
    t = time.time()
    sessions = session_factory(settings.resolved_database_url())
    with sessions.begin() as s:
        requeued = job_recovery.requeue_expired(s, max_attempts=settings.max_attempts,
                                                backoff_s=settings.retry_backoff_s)
        owed = dict(job_messages.unsent(s))
        waiting = job_recovery.queued_before(s, int(t - resend_after_s))
        due = {**{j: nb for j, nb in owed.items() if nb}, **{j: jobs.get_for_worker(s, j).not_before for j in requeued}}
        waiting_evals = evals.queued_before(s, int(t - resend_after_s))
        lost_evals = evals.fail_expired(s)
        released = tinker.expire_sessions(s, t, settings.tinker_session_timeout_s)
        tinker.prune_ended(s, t - settings.tinker_request_retention_s)
    for model_id in released:
        log.info("tinker model %s: its session stopped heartbeating; released", model_id)
    for job_id in requeued:
        log.warning("job %s: lease expired; re-queued", job_id)
    for eval_id in lost_evals:
        log.warning("eval run %s: lease expired; failed", eval_id)
    resend = list(dict.fromkeys(requeued + list(owed) + [
        j for j in waiting if t - sent.get(j, 0.0) > resend_after_s]))
    done = []
    for job_id in resend:  # after commit, as every enqueue; a job in a backoff waits it out in the broker
        try:
            enqueue_job(job_id, max(0.0, (due.get(job_id) or t) - t), settings)
        except Exception:  # the broker is still down: the job stays owed, the next pass tries again
            log.warning("job %s: could not send its message; the next pass retries", job_id, exc_info=True)
            with sessions.begin() as s:
                job_messages.mark_unsent(s, job_id)
            continue
        sent[job_id] = t
        done.append(job_id)
        if job_id in owed:
            with sessions.begin() as s:
                job_messages.mark_sent(s, job_id)
    for eval_id in waiting_evals:
        if t - sent.get(eval_id, 0.0) <= resend_after_s:
            continue
        try:
            enqueue_eval(eval_id, settings=settings)
        except Exception:  # the next pass tries again
            log.warning("eval run %s: could not send its message; the next pass retries", eval_id, exc_info=True)
            continue
        sent[eval_id] = t
        done.append(eval_id)
    return done


def start(settings: Settings, interval_s: float = 30.0) -> threading.Event:
    """Run reconcile_once (and sweep this worker's scratch space, worker/scratch.py) every interval in a daemon
    thread; set the returned event to stop."""
    stop = threading.Event()
    sent: dict[str, float] = {}

    def loop():
        sweep()  # what a killed worker left here, before its first interval
        while not stop.wait(interval_s):
            try:
                reconcile_once(settings, sent=sent)
            except Exception:
                log.exception("reconciler pass failed")
            sweep()

    def sweep():
        try:
            scratch.sweep(settings)
        except Exception:
            log.exception("scratch sweep failed")

    threading.Thread(target=loop, name="reconciler", daemon=True).start()
    return stop
