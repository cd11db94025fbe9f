"""The broker: one Celery app configuration shared by the API (which only sends)
and the worker (which runs tasks). Messages carry a job id and nothing else;
the SQL row is the truth, so a lost or duplicated message is harmless.
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

from service.private_paths import private_file, sqlite_file
from service.settings import Settings, get_settings

RUN_JOB = "worker.run_job"
RUN_EVAL = "worker.run_eval"
JOBS_QUEUE = "jobs"


def make_celery(settings: Settings) -> Celery:
    broker = settings.resolved_broker_url()
    if (path := sqlite_file(broker)) is not None:
        private_file(path)
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
        timeout = settings.broker_timeout_s
        app.conf.broker_transport_options = {
            # Redis redelivers unacked messages after this long, even to a live worker;
            # the lease makes a duplicate harmless, so keep it long.
            "visibility_timeout": 2 * 3600,
            # A Redis that accepts connections but stops answering must fail a send or a ping,
            # not hang the request (and, thread by thread, the whole API) forever.
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "socket_keepalive": True,
        }
        app.conf.broker_connection_timeout = timeout
        # One quick retry for a blip (a dropped connection); a broker still gone is the reconciler's
        # to repair from SQL.
        app.conf.task_publish_retry_policy = {"max_retries": 1, "interval_start": 0, "interval_step": 0.5,
                                              "interval_max": 0.5, "errback": _no_retry_after_a_timeout}
    return app


def _no_retry_after_a_timeout(exc: Exception, _interval: float) -> None:
    """A timeout means the broker is stalled, not briefly gone: a reconnect and a second send would each
    wait out another socket timeout, tripling the time an API request hangs on it."""
    from redis.exceptions import TimeoutError as RedisTimeout

    if isinstance(exc, RedisTimeout):
        raise exc


@lru_cache
def celery_app() -> Celery:
    return make_celery(get_settings())


def enqueue_job(job_id: str, delay_s: float = 0.0, settings: Settings | None = None) -> None:
    """Ask a worker to run the job (not before delay_s); call only after the job row is committed.
    `settings` other than the process's name another broker (tests, tools)."""
    app = celery_app() if settings is None or settings is get_settings() else make_celery(settings)
    app.send_task(RUN_JOB, args=[job_id], queue=JOBS_QUEUE, countdown=delay_s or None)


def enqueue_eval(eval_id: str, *, app: Celery | None = None, settings: Settings | None = None, delay_s: float = 0.0,
                 yielded: int = 0) -> None:
    """Ask a worker to run the eval run (not before delay_s); call only after its row is committed. `yielded`:
    how often a worker already handed the run's turn to another project (worker/jobs/eval_turns.py)."""
    if app is None:
        app = celery_app() if settings is None or settings is get_settings() else make_celery(settings)
    app.send_task(RUN_EVAL, args=[eval_id, yielded] if yielded else [eval_id], queue=JOBS_QUEUE,
                  countdown=delay_s or None)


def ping(app: Celery) -> None:
    """One connection attempt, bounded by the broker's socket timeouts: a retry would add kombu's 2 s
    back-off and another timeout, and a probe must answer before its caller gives up on it."""
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=0)


def broker_ping() -> None:
    ping(celery_app())
