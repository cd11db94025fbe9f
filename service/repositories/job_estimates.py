"""What a project's earlier jobs measured, read for the estimates made before a job runs: the dry run's duration
(service/dry_run.py) and the trained tokens and worker-seconds of the cost estimate (service/cost_estimate.py)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Job, JobMetric


def recent_on_model(session: Session, project_id: str, model: str, *, limit: int) -> list[tuple]:
    """The newest `limit` jobs of the project on this base model, any status: (id, spec, started_at, finished_at,
    status) each, newest first."""
    return [tuple(row) for row in session.execute(
        select(Job.id, Job.spec, Job.started_at, Job.finished_at, Job.status)
        .where(Job.project_id == project_id, Job.model == model).order_by(Job.seq.desc()).limit(limit))]


def metric_values(session: Session, job_id: str, names: tuple[str, ...]) -> dict[str, list[float]]:
    """Every recorded value of these metrics of one job, by name (names it never recorded are absent)."""
    values: dict[str, list[float]] = {}
    for name, value in session.execute(select(JobMetric.name, JobMetric.value).where(
            JobMetric.job_id == job_id, JobMetric.name.in_(names))):
        values.setdefault(name, []).append(value)
    return values


def trained_runs(session: Session, project_id: str, model: str | None, *, limit: int) -> list[tuple[int, int, int]]:
    """(started_at, finished_at, trained_tokens) of the newest `limit` succeeded jobs of the project that trained
    (on this base model, or on any when None), newest first."""
    query = select(Job.started_at, Job.finished_at, Job.trained_tokens).where(
        Job.project_id == project_id, Job.status == "succeeded", Job.trained_tokens > 0,
        Job.started_at.is_not(None), Job.finished_at.is_not(None))
    if model is not None:
        query = query.where(Job.model == model)
    return [tuple(row) for row in session.execute(query.order_by(Job.seq.desc()).limit(limit))]
