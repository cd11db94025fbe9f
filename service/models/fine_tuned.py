"""Fine-tuned models (OpenAI's /v1/models): a succeeded job's adapter, named ft:<base>:<project>:<suffix>:<job id>.

A model is not a row of its own: it is a view of its job, so it can never
disagree with the job. Deleting one marks the job's model retired and drops
its checkpoints; the caller removes the stored objects after the commit.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.db.models import Job
from service.errors import NotFound
from service.repositories import fine_tuned_models as models_repo
from service.repositories.pagination import Page


def model_id(job: Job, project_name: str) -> str:
    # The base the adapter applies to: a job that continued a fine-tuned model has `ft:...` as its model.
    base = (job.spec or {}).get("model", job.model)
    return f"ft:{base}:{project_name}:{job.suffix or ''}:{job.id}"


def list_models(session: Session, project_id: str, *, after_job_id: str | None, limit: int) -> Page[Job]:
    return models_repo.page(session, project_id, after=after_job_id, limit=limit)


def get(session: Session, project_id: str, project_name: str, requested: str) -> Job:
    """The job behind a model id; the whole id must match, so a stale base or suffix is a 404 too."""
    job_id = requested.rsplit(":", 1)[-1]
    job = models_repo.get(session, project_id, job_id) if requested.startswith("ft:") else None
    if job is None or model_id(job, project_name) != requested:
        raise NotFound(f"no such model: {requested} (GET /v1/models lists this project's fine-tuned models)",
                       param="model", code="model_not_found")
    return job


def delete(session: Session, project_id: str, project_name: str, requested: str) -> list[str]:
    """Retire the model; returns the storage prefixes of its checkpoints, to delete once this commits."""
    job = get(session, project_id, project_name, requested)
    return models_repo.retire(session, job)
