"""A minimal queued job row, for the repository tests that need one to claim, fence or rewind."""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.db.models import Job
from service.repositories import jobs


def queued_job(s: Session, project_id: str, *, seed: int = 1, total_steps: int = 10) -> str:
    return jobs.add(s, Job(project_id=project_id, status="queued", model="m", training_file="file-x", spec={},
                           method={"type": "cispo"}, seed=seed, total_steps=total_steps)).id
