"""Reads across all projects, for operators (GET /metrics): counts and running jobs' latest figures."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from service.db.models import Job, JobMetric


# The step metrics a running job's gauges show: the latest recorded value of each.
GAUGED_METRICS = ("reward_mean", "tokens_per_second", "sampled_tokens_per_second")


@dataclass(frozen=True)
class RunningJob:
    id: str
    steps_done: int
    total_steps: int
    latest: dict[str, float]  # GAUGED_METRICS at the latest step that recorded each (absent: none yet)


def jobs_by_status(session: Session) -> dict[str, int]:
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).tuples().all())


def running_jobs(session: Session) -> list[RunningJob]:
    jobs = session.execute(select(Job.id, Job.steps_done, Job.total_steps).where(Job.status == "running")
                           .order_by(Job.seq)).all()
    ids = [j.id for j in jobs]
    latest_step = (select(JobMetric.job_id, JobMetric.name, func.max(JobMetric.step).label("step"))
                   .where(JobMetric.name.in_(GAUGED_METRICS), JobMetric.job_id.in_(ids))
                   .group_by(JobMetric.job_id, JobMetric.name).subquery())
    values: dict[str, dict[str, float]] = {}
    if ids:
        for job_id, name, value in session.execute(
                select(JobMetric.job_id, JobMetric.name, JobMetric.value)
                .join(latest_step, and_(JobMetric.job_id == latest_step.c.job_id,
                                        JobMetric.name == latest_step.c.name,
                                        JobMetric.step == latest_step.c.step))).tuples():
            values.setdefault(job_id, {})[name] = value
    return [RunningJob(j.id, j.steps_done, j.total_steps, values.get(j.id, {})) for j in jobs]
