"""The queue of jobs waiting for a worker: the order workers take them in, and each queued job's place in it.

Shared workers (CISPO_WORKER_JOBS > 1) fill free slots with queued jobs of
their base in the fair-share order (service/fair_share.py). Workers of one
job each take whatever the broker hands them, oldest first; their queue is
every queued job, in creation order.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from sqlalchemy import func, or_, select, tuple_
from sqlalchemy.orm import Session

from service.db.models import Job, Project
from service.fair_share import Waiting, fair_order


def fair_queue(session: Session, model: str, weights: Mapping[str, float]) -> list[str]:
    """Ids of the queued jobs of base `model`, in the order a shared worker's free slots take them."""
    waiting = [Waiting(job_id, project, created_at, seq) for job_id, project, created_at, seq in session.execute(
        select(Job.id, Project.name, Job.created_at, Job.seq).join(Project, Project.id == Job.project_id)
        .where(Job.status == "queued", Job.model == model))]
    running = dict(session.execute(
        select(Project.name, func.count()).select_from(Job).join(Project, Project.id == Job.project_id)
        .where(Job.status == "running", Job.model == model).group_by(Project.name)).all())
    return fair_order(waiting, running, weights)


def waiting_of_base(session: Session, model: str, weights: Mapping[str, float], limit: int) -> list[tuple[str, dict]]:
    """(id, spec) of the first `limit` jobs of the fair queue of `model` that are past any backoff: the
    candidates for a shared worker's free slots."""
    order = fair_queue(session, model, weights)[:limit]
    if not order:
        return []
    t = time.time()
    specs = dict(session.execute(select(Job.id, Job.spec).where(
        Job.id.in_(order), Job.status == "queued", or_(Job.not_before.is_(None), Job.not_before <= t))).all())
    return [(job_id, specs[job_id]) for job_id in order if job_id in specs]


def positions(session: Session, queued: list[Job], *, fair: bool, weights: Mapping[str, float]) -> dict[str, int]:
    """Each queued job's place (1: next) in the queue workers take it from: with `fair`, the fair-share queue of
    its base model; otherwise every queued job, oldest first."""
    queued = [j for j in queued if j.status == "queued"]
    places: dict[str, int] = {}
    if fair:
        for model in {j.model for j in queued}:
            order = fair_queue(session, model, weights)
            places.update({job_id: i + 1 for i, job_id in enumerate(order)})
        return {j.id: places[j.id] for j in queued if j.id in places}
    for j in queued:
        ahead = session.scalar(select(func.count()).select_from(Job).where(
            Job.status == "queued", tuple_(Job.created_at, Job.seq) < tuple_(j.created_at, j.seq)))
        places[j.id] = ahead + 1
    return places
