"""SQL access to eval runs. The worker's writes are compare-and-set on the status, so a duplicate broker
message finds the run taken and leaves it alone."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db.models import EvalRun, now
from service.repositories.pagination import Page, paginate


def add(session: Session, run: EvalRun) -> EvalRun:
    session.add(run)
    session.flush()
    return run


def get(session: Session, project_id: str, eval_id: str) -> EvalRun | None:
    return session.scalar(select(EvalRun).where(EvalRun.project_id == project_id, EvalRun.id == eval_id))


def get_for_worker(session: Session, eval_id: str) -> EvalRun | None:
    return session.scalar(select(EvalRun).where(EvalRun.id == eval_id))


def page(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[EvalRun]:
    return paginate(session, select(EvalRun).where(EvalRun.project_id == project_id), EvalRun, after=after,
                    limit=limit)


def claim(session: Session, eval_id: str, owner: str) -> bool:
    """queued -> running for this worker; False when another took it or it is no longer queued."""
    done = session.execute(update(EvalRun).where(EvalRun.id == eval_id, EvalRun.status == "queued")
                           .values(status="running", owner=owner, started_at=now()))
    return done.rowcount == 1


def finish(session: Session, eval_id: str, owner: str, *, status: str, result: dict | None = None,
           result_file_id: str | None = None, error_code: str | None = None,
           error_message: str | None = None) -> bool:
    """running -> succeeded | failed, only by the worker that claimed it."""
    done = session.execute(update(EvalRun).where(EvalRun.id == eval_id, EvalRun.status == "running",
                                                 EvalRun.owner == owner)
                           .values(status=status, result=result, result_file_id=result_file_id,
                                   error_code=error_code, error_message=error_message, finished_at=now()))
    return done.rowcount == 1


def queued_before(session: Session, created_before: int) -> list[str]:
    """Eval runs queued since before a moment: candidates for a lost broker message."""
    return list(session.scalars(select(EvalRun.id).where(EvalRun.status == "queued",
                                                         EvalRun.created_at < created_before)))
