"""The Celery worker: `celery -A worker.celery_app worker` (or `cispo worker`).

Concurrency 1 and a fresh child per job: a job owns the GPU, and its CUDA
context and memory go away with the process.
"""

from __future__ import annotations

import logging

from celery.signals import worker_ready

from service.queue import RUN_JOB, make_celery
from service.settings import get_settings

log = logging.getLogger(__name__)

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
