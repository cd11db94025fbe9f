"""Fine-tuned models are succeeded jobs whose model was not deleted: their queries and retirement."""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.db.models import Checkpoint, Job, now
from service.repositories.jobs import add_event
from service.repositories.pagination import Page, paginate


def _models(project_id: str):
    return select(Job).where(Job.project_id == project_id, Job.status == "succeeded",
                             Job.model_deleted_at.is_(None))


def page(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[Job]:
    return paginate(session, _models(project_id), Job, after=after, limit=limit)


def get(session: Session, project_id: str, job_id: str) -> Job | None:
    return session.scalar(_models(project_id).where(Job.id == job_id))


def retire(session: Session, job: Job) -> list[str]:
    """Mark the model deleted (once: a racing second delete changes nothing) and drop its checkpoint rows; the job
    no longer names a best checkpoint (it went with them)."""
    marked = session.execute(update(Job).where(Job.id == job.id, Job.model_deleted_at.is_(None))
                             .values(model_deleted_at=now(), best_checkpoint_id=None)
                             .execution_options(synchronize_session=False))
    if marked.rowcount != 1:
        return []
    prefixes = list(session.scalars(select(Checkpoint.storage_prefix).where(Checkpoint.job_id == job.id)))
    session.execute(delete(Checkpoint).where(Checkpoint.job_id == job.id))
    add_event(session, job.id, "Fine-tuned model deleted; its checkpoints were removed")
    return prefixes
