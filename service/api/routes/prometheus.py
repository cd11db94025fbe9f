"""GET /metrics for Prometheus (text exposition format 0.0.4, by prometheus_client), for operators only.

It is off unless CISPO_METRICS_TOKEN is set, and then wants that token as a
Bearer (Prometheus' `authorization` scrape setting). Project API keys do not
open it: it counts every tenant's jobs. Job ids are the only tenant data it
shows (as labels of running jobs' gauges); no names, metadata or project ids.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

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


def _gauge(name: str, help_: str, label: str | None, samples: list[tuple[str, float | None]]) -> GaugeMetricFamily:
    """One gauge family; a value of None (nothing measured yet) is exposed as NaN."""
    family = GaugeMetricFamily(name, help_, labels=[label] if label else [])
    for value, number in samples:
        family.add_metric([value] if label else [], float("nan") if number is None else float(number))
    return family


class FleetGauges:
    """The jobs' gauges, read from the database once per scrape (the same in every API process)."""

    def __init__(self, counts: dict[str, int], running: list):
        self.counts, self.running = counts, running

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts, running = self.counts, self.running
        yield _gauge("cispo_jobs", "Jobs by status, all projects.", "status",
                     [(s, counts.get(s, 0)) for s in (*LIVE, *TERMINAL)])
        yield _gauge("cispo_queue_depth", "Jobs waiting for a worker (status queued, from the database).", None,
                     [("", counts.get("queued", 0))])
        yield _gauge("cispo_job_step", "Steps done by each running job.", "job_id",
                     [(j.id, j.steps_done) for j in running])
        yield _gauge("cispo_job_total_steps", "Steps each running job will take.", "job_id",
                     [(j.id, j.total_steps) for j in running])
        for metric, help_ in (("reward_mean", "mean reward"), ("tokens_per_second", "tokens (prompt and "
                              "completion) per second of step time"), ("sampled_tokens_per_second", "completion "
                              "tokens sampled per second of rollout time")):
            yield _gauge(f"cispo_job_{metric}", f"Each running job's {help_} at its latest step (NaN: none yet).",
                         "job_id", [(j.id, j.latest.get(metric)) for j in running])


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request, session: SessionDep, settings: SettingsDep,
            authorization: Annotated[str | None, Header()] = None) -> Response:
    _check_token(settings.metrics_token, authorization)
    fleet_registry = CollectorRegistry()
    fleet_registry.register(FleetGauges(fleet.jobs_by_status(session), fleet.running_jobs(session)))
    session.rollback()
    # Two registries, two sets of metric families: their expositions concatenate into one valid text.
    body = generate_latest(request.app.state.request_metrics.registry()) + generate_latest(fleet_registry)
    return Response(body, media_type=CONTENT_TYPE)
