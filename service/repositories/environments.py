"""Registered environments, always read within one project."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Environment, Job
from service.repositories.jobs import LIVE
from service.repositories.pagination import Page, paginate


def add(session: Session, env: Environment) -> Environment:
    session.add(env)
    session.flush()
    return env


def get(session: Session, project_id: str, env_id: str) -> Environment | None:
    return session.scalar(select(Environment).where(Environment.project_id == project_id, Environment.id == env_id))


def page(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[Environment]:
    return paginate(session, select(Environment).where(Environment.project_id == project_id), Environment,
                    after=after, limit=limit)


def live_job_using(session: Session, project_id: str, env_id: str) -> str | None:
    """The id of a job that has not finished and runs this environment, if any."""
    stmt = select(Job.id).where(Job.project_id == project_id, Job.status.in_(LIVE), Job.environment_id == env_id)
    return session.scalar(stmt.limit(1))


def delete(session: Session, env: Environment) -> None:
    session.delete(env)
    session.flush()
