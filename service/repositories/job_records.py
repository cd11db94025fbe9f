"""What a run records as it goes, each write fenced by its lease epoch (service/repositories/job_lease.py):
every step's metrics and the job's trained-token total, its checkpoints and their retention, and an outage of
the object store it is waiting out."""

from __future__ import annotations

import time

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.db.models import Checkpoint, Job, JobMetric
from service.repositories import job_history
from service.repositories.inserts import upsert
from service.repositories.job_lease import fenced


def record_step(session: Session, job_id: str, epoch: int, step: int, values: dict[str, float],
                *, trained_tokens: int, ttl_s: float) -> bool:
    """Store one step's metrics and renew the lease; False if the lease is lost.

    A step recorded again (a re-run after a resume) replaces its values. `trained_tokens` (0: none, as for an
    evaluation) is kept as the step's trained_tokens metric; the job's total changes by the difference from
    what the step held before, so it is the sum over steps and a re-run step counts once."""
    if trained_tokens:
        values = {**values, job_history.TOKENS: trained_tokens}
    added = 0
    if job_history.TOKENS in values:
        added = int(values[job_history.TOKENS]) - job_history.step_tokens(session, job_id, step)
    result = session.execute(
        update(Job).where(fenced(job_id, epoch))
        .values(steps_done=func.max(Job.steps_done, step) if session.get_bind().dialect.name == "sqlite"
                else func.greatest(Job.steps_done, step),
                trained_tokens=Job.trained_tokens + added, lease_expires_at=time.time() + ttl_s)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return False
    upsert(session, JobMetric, [{"job_id": job_id, "step": step, "name": k, "value": float(v)}
                                for k, v in values.items()], ["job_id", "step", "name"])
    return True


def add_checkpoint(session: Session, job_id: str, epoch: int, *, step: int, storage_prefix: str,
                   files: dict, metrics: dict, ttl_s: float | None = None) -> Checkpoint | None:
    """Point at an uploaded, hashed checkpoint; None if the lease is lost.

    The fence is an UPDATE (it renews the lease when given ttl_s), not a SELECT: it locks the job row until
    commit, so a claim racing with this write waits, and then takes the job with this checkpoint recorded.
    """
    expires = Job.lease_expires_at if ttl_s is None else time.time() + ttl_s
    result = session.execute(  # the store took a whole checkpoint: any outage is over
        update(Job).where(fenced(job_id, epoch)).values(lease_expires_at=expires, outage_since=None)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    existing = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
    if existing is not None:
        return existing
    ckpt = Checkpoint(job_id=job_id, step=step, storage_prefix=storage_prefix, files=files, metrics=metrics)
    session.add(ckpt)
    session.flush()
    return ckpt


def prune_checkpoints(session: Session, job_id: str, epoch: int, keep: int, *, spare: str | None = None) -> list[str]:
    """Forget all but the newest `keep` checkpoints and `spare` (a checkpoint id kept besides them: the best
    one, training.keep_best), fenced; returns their storage prefixes to delete."""
    if session.scalar(select(Job.id).where(fenced(job_id, epoch))) is None:
        return []
    old = [c for c in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                                      .order_by(Checkpoint.step.desc()).offset(keep)) if c.id != spare]
    for ckpt in old:
        session.delete(ckpt)
    session.flush()
    return [c.storage_prefix for c in old]


def note_outage(session: Session, job_id: str, epoch: int) -> float | None:
    """The run met an unreachable object store: returns since when it has been so for the job (fenced; None if
    the lease is lost). A committed checkpoint (add_checkpoint) ends the outage."""
    result = session.execute(update(Job).where(fenced(job_id, epoch))
                             .values(outage_since=func.coalesce(Job.outage_since, time.time()))
                             .execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return None
    return session.scalar(select(Job.outage_since).where(Job.id == job_id))
