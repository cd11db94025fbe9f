"""The broker: one Celery app configuration shared by the API (which only sends)
and the worker (which runs tasks). Messages carry a job id and nothing else;
the SQL row is the truth, so a lost or duplicated message is harmless.
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

from service.settings import Settings, get_settings

RUN_JOB = "worker.run_job"
JOBS_QUEUE = "jobs"


def make_celery(settings: Settings) -> Celery:
    broker = settings.resolved_broker_url()
    if broker.startswith("sqla+sqlite:///"):
        settings.home.mkdir(parents=True, exist_ok=True)
    app = Celery("cispo", broker=broker)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],  # never pickle: messages may come from anywhere on the network
        task_acks_late=True,  # a worker that dies mid-job leaves the message for another
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # long jobs must not park queued ones behind them
        task_default_queue=JOBS_QUEUE,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    if broker.startswith(("redis://", "rediss://")):
        # Redis redelivers unacked messages after this long, even to a live worker;
        # the lease makes a duplicate harmless, so keep it long.
        app.conf.broker_transport_options = {"visibility_timeout": 2 * 3600}
    return app


@lru_cache
def celery_app() -> Celery:
    return make_celery(get_settings())


def enqueue_job(job_id: str) -> None:
    """Ask a worker to run the job; call only after the job row is committed."""
    celery_app().send_task(RUN_JOB, args=[job_id], queue=JOBS_QUEUE)


def broker_ping(timeout_s: float = 2.0) -> None:
    with celery_app().connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=timeout_s)
