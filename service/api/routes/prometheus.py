"""GET /metrics for Prometheus (text exposition format 0.0.4), for operators only.

It is off unless CISPO_METRICS_TOKEN is set, and then wants that token as a
Bearer (Prometheus' `authorization` scrape setting). Project API keys do not
open it: it counts every tenant's jobs. Job ids are the only tenant data it
shows (as labels of running jobs' gauges); no names, metadata or project ids.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import PlainTextResponse

from service.api.deps import SessionDep, SettingsDep
from service.auth import Unauthenticated
from service.errors import NotFound
from service.repositories import fleet
from service.repositories.jobs import LIVE, TERMINAL

router = APIRouter(tags=["operations"])
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _check_token(expected: str, authorization: str | None) -> None:
    if not expected:
        raise NotFound("/metrics is disabled: set CISPO_METRICS_TOKEN to enable it", param=None)
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise Unauthenticated("/metrics wants 'Authorization: Bearer <CISPO_METRICS_TOKEN>'")


def _gauge(name: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
    return lines + [f"{name}{labels} {value}" for labels, value in samples]


def _number(value: float | None) -> str:
    return "NaN" if value is None else repr(float(value))


@router.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
def metrics(request: Request, session: SessionDep, settings: SettingsDep,
            authorization: Annotated[str | None, Header()] = None) -> PlainTextResponse:
    _check_token(settings.metrics_token, authorization)
    counts = fleet.jobs_by_status(session)
    running = fleet.running_jobs(session)
    session.rollback()
    lines = request.app.state.request_metrics.exposition()
    lines += _gauge("cispo_jobs", "Jobs by status, all projects.",
                    [(f'{{status="{s}"}}', counts.get(s, 0)) for s in (*LIVE, *TERMINAL)])
    lines += _gauge("cispo_queue_depth", "Jobs waiting for a worker (status queued, from the database).",
                    [("", counts.get("queued", 0))])
    lines += _gauge("cispo_job_step", "Steps done by each running job.",
                    [(f'{{job_id="{j.id}"}}', j.steps_done) for j in running])
    lines += _gauge("cispo_job_total_steps", "Steps each running job will take.",
                    [(f'{{job_id="{j.id}"}}', j.total_steps) for j in running])
    for metric, help_ in (("reward_mean", "mean reward"), ("tokens_per_second", "tokens (prompt and completion) "
                          "per second of step time"), ("sampled_tokens_per_second", "completion tokens sampled per "
                          "second of rollout time")):
        lines += _gauge(f"cispo_job_{metric}", f"Each running job's {help_} at its latest step (NaN: none yet).",
                        [(f'{{job_id="{j.id}"}}', _number(j.latest.get(metric))) for j in running])
    return PlainTextResponse("\n".join(lines) + "\n", media_type=CONTENT_TYPE)
