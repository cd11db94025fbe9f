"""Jobs: the state machine, the worker's lease, and the records a run leaves.

Every status change is a compare-and-set UPDATE (WHERE status = the expected
one), so two racing requests cannot both win. Worker writes are fenced by the
lease epoch: a worker that lost its lease (paused past its TTL, partitioned)
has every later write refused, and stops.

    validating_files -> queued -> running -> succeeded | failed | cancelled
    queued | running -> paused -> queued          (pause / resume)
    running -> queued                              (lease expired or a transient error: retried after
                                                    a backoff; a graceful worker shutdown: at once)

A run uses up one of `max_attempts` when it is claimed; a pause or a graceful
shutdown gives it back, so only crashes and failures count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.db.models import Checkpoint, Job, JobEvent, JobMetric, Project, now
from service.repositories import job_history
from service.repositories.pagination import Page, paginate

LIVE = ("validating_files", "queued", "running", "paused")
ACTIVE = ("validating_files", "queued", "running")  # what counts against a project's quota (paused does not)
TERMINAL = ("succeeded", "failed", "cancelled")


class IllegalTransition(Exception):
    def __init__(self, job: Job, action: str):
        super().__init__(f"job {job.id} is {job.status}; it cannot be {action}")
        self.job, self.action = job, action


@dataclass(frozen=True)
class Control:
    """What the API has asked of a running job."""

    cancel: bool
    pause: bool


# -- reads -------------------------------------------------------------------


def get(session: Session, project_id: str, job_id: str) -> Job | None:
    return session.scalar(select(Job).where(Job.project_id == project_id, Job.id == job_id))


def get_for_worker(session: Session, job_id: str) -> Job | None:
    return session.scalar(select(Job).where(Job.id == job_id))


def page(session: Session, project_id: str, *, after: str | None, limit: int,
         metadata: dict[str, str] | None = None) -> Page[Job]:
    stmt = select(Job).where(Job.project_id == project_id)
    items_filter = metadata or {}
    if not items_filter:
        return paginate(session, stmt, Job, after=after, limit=limit)
    # JSON containment differs by dialect; metadata is small, so filter in Python page by page.
    result, cursor = [], after
    while True:
        chunk = paginate(session, stmt, Job, after=cursor, limit=max(limit, 50))
        for job in chunk.items:
            if all((job.metadata_ or {}).get(k) == v for k, v in items_filter.items()):
                if len(result) == limit:
                    return Page(items=result, has_more=True)
                result.append(job)
        if not chunk.has_more:
            return Page(items=result, has_more=False)
        cursor = chunk.items[-1].id


def find_by_idempotency_key(session: Session, project_id: str, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.project_id == project_id, Job.idempotency_key == key))


def active_count(session: Session, project_id: str) -> int:
    """Queued and running jobs of the project. Locks the project row on PostgreSQL, so two concurrent
    creates cannot both see room for one more (SQLite's BEGIN IMMEDIATE already serializes writers)."""
    session.execute(select(Project.id).where(Project.id == project_id).with_for_update())
    return session.scalar(select(func.count()).select_from(Job).where(Job.project_id == project_id,
                                                                      Job.status.in_(ACTIVE)))


def live_job_uses(session: Session, project_id: str, *, file_id: str | None = None,
                  reward_function_id: str | None = None) -> str | None:
    """The id of a live job that references the file or reward function, if any."""
    stmt = select(Job.id).where(Job.project_id == project_id, Job.status.in_(LIVE))
    if file_id:
        stmt = stmt.where(or_(Job.training_file == file_id, Job.validation_file == file_id))
    if reward_function_id:
        stmt = stmt.where(Job.reward_function_id == reward_function_id)
    return session.scalar(stmt.limit(1))


def events(session: Session, job_id: str, *, after: str | None, limit: int) -> Page[JobEvent]:
    return paginate(session, select(JobEvent).where(JobEvent.job_id == job_id), JobEvent, after=after, limit=limit)


def checkpoints(session: Session, job_id: str, *, after: str | None, limit: int) -> Page[Checkpoint]:
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id)
    return paginate(session, stmt, Checkpoint, after=after, limit=limit)


def checkpoint(session: Session, job_id: str, checkpoint_id: str) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.id == checkpoint_id))


def project_checkpoint(session: Session, project_id: str, checkpoint_id: str) -> Checkpoint | None:
    """A checkpoint of any job of the project (a continued job's starting point)."""
    return session.scalar(select(Checkpoint).join(Job, Job.id == Checkpoint.job_id)
                          .where(Checkpoint.id == checkpoint_id, Job.project_id == project_id))


def latest_checkpoint(session: Session, job_id: str) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()))


def metrics(session: Session, job_id: str, *, names: list[str] | None, step_min: int | None,
            step_max: int | None, limit: int) -> list[JobMetric]:
    stmt = select(JobMetric).where(JobMetric.job_id == job_id)
    if names:
        stmt = stmt.where(JobMetric.name.in_(names))
    if step_min is not None:
        stmt = stmt.where(JobMetric.step >= step_min)
    if step_max is not None:
        stmt = stmt.where(JobMetric.step <= step_max)
    return list(session.scalars(stmt.order_by(JobMetric.step, JobMetric.name).limit(limit)))


# -- API-side changes --------------------------------------------------------


def add(session: Session, job: Job) -> Job:
    session.add(job)
    session.flush()
    return job


def add_event(session: Session, job_id: str, message: str, *, level: str = "info", type: str = "message",
              data: dict | None = None) -> JobEvent:
    event = JobEvent(job_id=job_id, message=message, level=level, type=type, data=data)
    session.add(event)
    session.flush()
    return event


def _cas(session: Session, job: Job, expected: tuple[str, ...], **values) -> bool:
    result = session.execute(
        update(Job).where(Job.id == job.id, Job.status.in_(expected)).values(**values)
        .execution_options(synchronize_session=False)
    )
    session.refresh(job)
    return result.rowcount == 1


def request_cancel(session: Session, job: Job) -> Job:
    """Queued or paused jobs end at once; a running job stops at its next step boundary."""
    if _cas(session, job, ("validating_files", "queued", "paused"), status="cancelled", finished_at=now(),
            lease_owner=None, lease_expires_at=None):
        add_event(session, job.id, "Job cancelled")
    elif _cas(session, job, ("running",), cancel_requested=True):
        add_event(session, job.id, "Cancellation requested; the job stops at the end of its current step")
    else:
        raise IllegalTransition(job, "cancelled")
    return job


def request_pause(session: Session, job: Job) -> Job:
    if _cas(session, job, ("queued",), status="paused"):
        add_event(session, job.id, "Job paused")
    elif _cas(session, job, ("running",), pause_requested=True):
        add_event(session, job.id, "Pause requested; the job checkpoints and pauses after its current step")
    else:
        raise IllegalTransition(job, "paused")
    return job


def resume(session: Session, job: Job) -> Job:
    if not _cas(session, job, ("paused",), status="queued", pause_requested=False):
        raise IllegalTransition(job, "resumed")
    add_event(session, job.id, "Job resumed")
    return job


# -- worker-side changes (fenced by the lease epoch) -------------------------


def retry_delay(attempts: int, *, base_s: float, cap_s: float = 360.0) -> float:
    """Exponential backoff before attempt `attempts + 1`: base, 2*base, 4*base, ... capped (as Kubernetes Jobs)."""
    return min(cap_s, base_s * 2 ** max(0, attempts - 1))


def outage_delay(elapsed_s: float, *, base_s: float, cap_s: float = 60.0) -> float:
    """Wait before trying again after an outage has lasted `elapsed_s`: about doubling, and never long once it
    is over (cap_s), since nothing about the job is wrong."""
    return min(cap_s, max(base_s, elapsed_s))


def note_outage(session: Session, job_id: str, epoch: int) -> float | None:
    """The run met an unreachable object store: returns since when it has been so for the job (fenced; None if
    the lease is lost). A committed checkpoint (add_checkpoint) ends the outage."""
    result = session.execute(update(Job).where(_fenced(job_id, epoch))
                             .values(outage_since=func.coalesce(Job.outage_since, time.time()))
                             .execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return None
    return session.scalar(select(Job.outage_since).where(Job.id == job_id))


def _runnable(t: float, max_attempts: int):
    """A queued job past its backoff, or a running one whose worker stopped renewing; with an attempt left."""
    return and_(
        Job.attempts < max_attempts,
        or_(and_(Job.status == "queued", or_(Job.not_before.is_(None), Job.not_before <= t)),
            and_(Job.status == "running", Job.lease_expires_at < t)),
    )


def claim(session: Session, job_id: str, owner: str, ttl_s: float, *, max_attempts: int = 3) -> int | None:
    """Take the lease on a runnable job (see _runnable); returns the epoch. The run uses up an attempt.

    What an earlier run recorded after the newest committed checkpoint is forgotten: this run does those
    steps again (service/repositories/job_history.py)."""
    t = time.time()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, _runnable(t, max_attempts))
        .values(status="running", lease_owner=owner, lease_epoch=Job.lease_epoch + 1,
                lease_expires_at=t + ttl_s, attempts=Job.attempts + 1, not_before=None, enqueue_failed_at=None,
                started_at=func.coalesce(Job.started_at, int(t)))
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    job_history.rewind(session, job_id)
    return session.scalar(select(Job.lease_epoch).where(Job.id == job_id))


def _fenced(job_id: str, epoch: int):
    return and_(Job.id == job_id, Job.lease_epoch == epoch, Job.status == "running")


def heartbeat(session: Session, job_id: str, epoch: int, ttl_s: float) -> Control | None:
    """Renew the lease; None means it is lost and the worker must stop writing."""
    result = session.execute(
        update(Job).where(_fenced(job_id, epoch)).values(lease_expires_at=time.time() + ttl_s)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    cancel, pause = session.execute(
        select(Job.cancel_requested, Job.pause_requested).where(Job.id == job_id)
    ).one()
    return Control(cancel=bool(cancel), pause=bool(pause))


def _insert_ignoring_duplicates(session: Session, model, rows: list[dict]) -> None:
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    session.execute(insert(model).values(rows).on_conflict_do_nothing())


def _upsert(session: Session, model, rows: list[dict], keys: list[str]) -> None:
    """Insert rows; a row that exists (same keys) takes the new values."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(model).values(rows)
    changed = {c: stmt.excluded[c] for c in rows[0] if c not in keys}
    session.execute(stmt.on_conflict_do_update(index_elements=keys, set_=changed))


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
        update(Job).where(_fenced(job_id, epoch))
        .values(steps_done=func.max(Job.steps_done, step) if session.get_bind().dialect.name == "sqlite"
                else func.greatest(Job.steps_done, step),
                trained_tokens=Job.trained_tokens + added, lease_expires_at=time.time() + ttl_s)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return False
    _upsert(session, JobMetric, [{"job_id": job_id, "step": step, "name": k, "value": float(v)}
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
        update(Job).where(_fenced(job_id, epoch)).values(lease_expires_at=expires, outage_since=None)
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
    if session.scalar(select(Job.id).where(_fenced(job_id, epoch))) is None:
        return []
    old = [c for c in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                                      .order_by(Checkpoint.step.desc()).offset(keep)) if c.id != spare]
    for ckpt in old:
        session.delete(ckpt)
    session.flush()
    return [c.storage_prefix for c in old]


def finish(session: Session, job_id: str, epoch: int, status: str, *, error_code: str | None = None,
           error_message: str | None = None, error_param: str | None = None) -> bool:
    """End the lease with a terminal status or `paused`. A pause gives the run's attempt back: it did not fail."""
    values: dict = {"status": status, "lease_owner": None, "lease_expires_at": None,
                    "cancel_requested": False, "pause_requested": False}
    if status in TERMINAL:
        values["finished_at"] = now()
    if status == "paused":
        values["attempts"] = Job.attempts - 1
    if error_code is not None:
        values.update(error_code=error_code, error_message=error_message, error_param=error_param)
    result = session.execute(
        update(Job).where(_fenced(job_id, epoch)).values(**values).execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def requeue(session: Session, job_id: str, epoch: int, *, delay_s: float = 0.0, failed: bool = True) -> bool:
    """End the lease and queue the job again (fenced). A failed run keeps its attempt and waits `delay_s`;
    one stopped by its worker's graceful shutdown (failed=False) gives the attempt back."""
    values: dict = {"status": "queued", "lease_owner": None, "lease_expires_at": None,
                    "not_before": time.time() + delay_s if delay_s > 0 else None}
    if not failed:
        values["attempts"] = Job.attempts - 1
    result = session.execute(
        update(Job).where(_fenced(job_id, epoch)).values(**values).execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def fail_exhausted(session: Session, job_id: str, max_attempts: int) -> bool:
    """Fail a job that is waiting for a run but has used all its attempts; a live lease is never touched."""
    t = time.time()
    result = session.execute(
        update(Job).where(
            Job.id == job_id, Job.attempts >= max_attempts,
            or_(Job.status == "queued", and_(Job.status == "running", Job.lease_expires_at < t)),
        )
        .values(status="failed", error_code="too_many_attempts",
                error_message=f"the job failed {max_attempts} times: its worker crashed or lost its lease "
                              "each time (see the job's events)",
                finished_at=now(), lease_owner=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1:
        add_event(session, job_id, f"Job failed: no attempts left after {max_attempts}", level="error")
    return result.rowcount == 1


def requeue_expired(session: Session, *, max_attempts: int, backoff_s: float) -> list[str]:
    """Queue again (after a backoff) running jobs whose worker stopped heartbeating, or fail those with no
    attempt left; returns the ids queued again."""
    t = time.time()
    expired = list(session.execute(select(Job.id, Job.attempts)
                                   .where(Job.status == "running", Job.lease_expires_at < t)))
    requeued = []
    for job_id, attempts in expired:
        if attempts >= max_attempts:
            fail_exhausted(session, job_id, max_attempts)
            continue
        delay = retry_delay(attempts, base_s=backoff_s)
        result = session.execute(
            update(Job).where(Job.id == job_id, Job.status == "running", Job.lease_expires_at < t)
            .values(status="queued", lease_owner=None, lease_expires_at=None, not_before=t + delay)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:
            add_event(session, job_id, f"The worker stopped responding; the job runs again in {delay:.0f} s "
                      f"(attempt {attempts + 1} of {max_attempts})", level="warn")
            requeued.append(job_id)
    return requeued


def queued_before(session: Session, created_before: int) -> list[str]:
    """Queued jobs older than a moment, past any retry backoff: candidates for a lost broker message."""
    t = time.time()
    return list(session.scalars(select(Job.id).where(
        Job.status == "queued", Job.created_at < created_before, or_(Job.not_before.is_(None), Job.not_before <= t))))

