"""Job rows for the repository tests: a minimal queued job to claim, fence or rewind, and a worker's claim on it,
each in its own transaction as the API and a worker would write them."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from service.db.models import Job
from service.repositories import job_lease, jobs, projects


def queued_job(s: Session, project_id: str, *, seed: int = 1, total_steps: int = 10, **columns) -> str:
    """A job row (queued unless `columns` say otherwise) of the project; its id."""
    return jobs.add(s, Job(**{"project_id": project_id, "status": "queued", "model": "m", "training_file": "file-x",
                              "spec": {}, "method": {"type": "cispo"}, "seed": seed, "total_steps": total_steps,
                              **columns})).id


def new_job(sessions: sessionmaker[Session], *, project: str = "p", **columns) -> tuple[str, str]:
    """A queued job of `project` (made if new), committed: (project id, job id)."""
    with sessions.begin() as s:
        project_id = projects.get_or_create_project(s, project).id
        return project_id, queued_job(s, project_id, **columns)


def claimed(sessions: sessionmaker[Session], job_id: str, owner: str = "w", *, ttl_s: float = 60) -> int:
    """A worker's claim on the job, committed; the lease epoch."""
    with sessions.begin() as s:
        epoch = job_lease.claim(s, job_id, owner, ttl_s=ttl_s)
    assert epoch is not None, f"{owner} could not claim {job_id}"
    return epoch
