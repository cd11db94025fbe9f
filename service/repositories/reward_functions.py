"""Registered reward functions."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import RewardFunction
from service.repositories.pagination import Page, paginate


def add(session: Session, fn: RewardFunction) -> RewardFunction:
    session.add(fn)
    session.flush()
    return fn


def get(session: Session, project_id: str, fn_id: str) -> RewardFunction | None:
    return session.scalar(
        select(RewardFunction).where(RewardFunction.project_id == project_id, RewardFunction.id == fn_id)
    )


def page(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[RewardFunction]:
    stmt = select(RewardFunction).where(RewardFunction.project_id == project_id)
    return paginate(session, stmt, RewardFunction, after=after, limit=limit)


def delete(session: Session, fn: RewardFunction) -> None:
    session.delete(fn)
    session.flush()
