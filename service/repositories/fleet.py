"""Reads across all projects, for operators (GET /metrics): counts and running jobs' latest figures."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from service.db.models import Job, JobMetric


@dataclass(frozen=True)
class RunningJob:
    id: str
    steps_done: int
    total_steps: int
    reward_mean: float | None  # at the latest step that recorded one


def jobs_by_status(session: Session) -> dict[str, int]:
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).tuples().all())


def running_jobs(session: Session) -> list[RunningJob]:
    jobs = session.execute(select(Job.id, Job.steps_done, Job.total_steps).where(Job.status == "running")
                           .order_by(Job.seq)).all()
    ids = [j.id for j in jobs]
    latest = (select(JobMetric.job_id, func.max(JobMetric.step).label("step"))
              .where(JobMetric.name == "reward_mean", JobMetric.job_id.in_(ids))
              .group_by(JobMetric.job_id).subquery())
    rewards = dict(session.execute(
        select(JobMetric.job_id, JobMetric.value)
        .join(latest, and_(JobMetric.job_id == latest.c.job_id, JobMetric.step == latest.c.step))
        .where(JobMetric.name == "reward_mean")).tuples().all()) if ids else {}
    return [RunningJob(j.id, j.steps_done, j.total_steps, rewards.get(j.id)) for j in jobs]
