"""The FastAPI application: wiring only (state, middleware, error envelope, routers).

Everything the routes need lives on app.state, built from one Settings object:
the session factory, the object store, `enqueue` (send a job id to the
broker) and `broker_ping`. Tests pass their own settings and a recording
`enqueue`; nothing here imports torch or the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager

from anyio import Semaphore, to_thread

from fastapi import FastAPI

from service.api import envelope
from service.api.access import Admission, Authenticate
from service.api.body_spool import BodySpool
from service.api.future_waits import FutureWaits
from service.api.judge_budget import JudgeBudget
from service.api.poll_cache import PollCache
from service.api.guards import BodySizeLimit, RefuseNulInUrl
from service.api.ratelimit import rate_limit, scoring_slots
from service.api.request_metrics import RecordRequests, RequestMetrics
from service.api.routes import (completions, environments, evals, files, graders, health, job_outputs, jobs, models,
                                prometheus, reward_functions, secrets, tinker, webhooks)
from service.dashboard import routes as dashboard
from service.auth import PrincipalCache
from service.db.session import read_session_factory, session_factory
from service.repositories import tinker as tinker_requests
from service.queue import JOBS_QUEUE, RUN_JOB, broker_ping, enqueue_eval, enqueue_job, make_celery, ping
from service.secrets.box import secret_box
from service.settings import Settings, get_settings
from service.storage import open_store


def _broker(settings: Settings) -> tuple[Callable[[str], None], Callable[[str], None], Callable[[], None]]:
    """(enqueue a job, enqueue an eval run, ping) for the settings' broker; service.queue's own when they are
    the process settings."""
    if settings is get_settings():
        return enqueue_job, enqueue_eval, broker_ping
    celery = make_celery(settings)

    def enqueue(job_id: str) -> None:
        celery.send_task(RUN_JOB, args=[job_id], queue=JOBS_QUEUE)

    return enqueue, lambda eval_id: enqueue_eval(eval_id, app=celery), lambda: ping(celery)


def _ended_among(read_sessions):
    def ended_among(request_ids: list[str]) -> set[str]:
        with read_sessions() as session:
            return tinker_requests.ended_among(session, request_ids)

    return ended_among


def _lifespan(threads: int):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Sync routes and the auth lookup run in anyio's default threadpool; size it to match the pool.
        to_thread.current_default_thread_limiter().total_tokens = threads
        app.state.admission = Semaphore(threads)  # service/api/access.py Admission; bound to this loop
        yield

    return lifespan


def create_app(settings: Settings | None = None, *, enqueue: Callable[[str], None] | None = None,
               enqueue_eval: Callable[[str], None] | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="CISPO fine-tuning service", version="1", summary="OpenAI-compatible reinforcement "
                  "fine-tuning with CISPO", lifespan=_lifespan(settings.api_threads))
    default_enqueue, default_enqueue_eval, probe = _broker(settings)
    app.state.settings = settings
    # Every API thread may hold a connection (+4 for /readyz and the auth middleware's touch).
    pool = {"pool_size": min(settings.db_pool_size, settings.api_threads),
            "max_connections": settings.api_threads + 4}
    app.state.sessions = session_factory(settings.resolved_database_url(), **pool)
    app.state.read_sessions = read_session_factory(settings.resolved_database_url(), **pool)
    app.state.store = open_store(settings.resolved_storage_url())
    app.state.enqueue = enqueue or default_enqueue
    app.state.enqueue_eval = enqueue_eval or default_enqueue_eval
    app.state.broker_ping = probe
    app.state.scoring_slots = scoring_slots(settings)
    app.state.judge_budget = JudgeBudget(settings.judge_tokens_per_project_hour)
    app.state.poll_cache = PollCache(settings.poll_cache_s)
    app.state.principals = PrincipalCache(settings.auth_cache_s)
    app.state.future_waits = FutureWaits(_ended_among(app.state.read_sessions))
    secret_box(settings)  # fail at start, not at the first secret, when CISPO_SECRET_KEY is unusable

    envelope.install(app)
    app.add_middleware(BodySpool, settings=settings)  # inside BodySizeLimit, which counts what it spools
    app.add_middleware(BodySizeLimit, max_json_bytes=settings.max_request_bytes,
                       max_upload_bytes=settings.max_upload_bytes,
                       max_protobuf_bytes=settings.tinker_max_body_bytes)
    app.add_middleware(Authenticate, reads=app.state.read_sessions, writes=app.state.sessions,
                       limits=rate_limit(settings),
                       principals=app.state.principals)
    app.add_middleware(Admission)
    app.add_middleware(RefuseNulInUrl)
    app.state.request_metrics = RequestMetrics()
    app.add_middleware(RecordRequests, metrics=app.state.request_metrics)  # outermost: times everything
    for module in (health, files, reward_functions, environments, jobs, job_outputs, evals, secrets, graders, models,
                   prometheus, dashboard, webhooks, completions, tinker):
        app.include_router(module.router)
    return app
