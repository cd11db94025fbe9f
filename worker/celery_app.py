"""The Celery worker: `celery -A worker.celery_app worker` (or `cispo worker`).

Concurrency 1 and a fresh child per job: a job owns the GPU, and its CUDA
context and memory go away with the process. Database pools are replaced in
every forked child (service.db.session), so children never share the
parent's connections.

Graceful shutdown (SIGTERM, a deploy): Celery's warm shutdown waits for the
running task, and this module tells the job to stop at its next step
boundary, checkpoint, and go back to the queue for another worker (DRAIN).
Give the worker a grace period of one step plus one checkpoint upload.
"""

from __future__ import annotations

import logging
import os
import signal

from billiard.process import active_children
from celery.signals import worker_process_init, worker_ready, worker_shutting_down

from service.queue import RUN_JOB, make_celery
from service.settings import get_settings

log = logging.getLogger(__name__)

# The signal the main process sends its pool children to drain; Celery resets SIGTERM and SIGUSR1 in
# children and uses SIGTERM to kill them on a cold shutdown, so it must be another one.
DRAIN_SIGNAL = signal.SIGUSR2

app = make_celery(get_settings())
app.conf.update(worker_concurrency=1, worker_max_tasks_per_child=1)


@app.task(name=RUN_JOB, acks_late=True)
def run_job(job_id: str) -> str | None:
    from worker.job_runner import run_job as run

    status = run(job_id, get_settings())
    log.info("job %s ended as %s", job_id, status)
    return status


@worker_ready.connect
def _start_reconciler(**_):
    from worker import reconciler, webhook_sender

    reconciler.start(get_settings(), interval_s=max(5.0, get_settings().lease_ttl_s / 3))
    webhook_sender.start(get_settings())


def _drain(*_):
    from worker.job_runner import DRAIN

    DRAIN.set()


@worker_process_init.connect
def _listen_for_drain(**_):
    signal.signal(DRAIN_SIGNAL, _drain)


@worker_shutting_down.connect
def _drain_jobs(how: str = "", **_):
    """Warm shutdown: the job in this process (solo pool) or in each pool child stops after a checkpoint."""
    log.warning("%s shutdown: running jobs checkpoint and go back to the queue", how)
    _drain()
    for child in active_children():
        try:
            os.kill(child.pid, DRAIN_SIGNAL)
        except ProcessLookupError:
            pass
