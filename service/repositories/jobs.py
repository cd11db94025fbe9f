"""Jobs as the API sees them: their states, the reads, creating one, and the changes a client asks for
(cancel, pause, resume).

Every status change is a compare-and-set UPDATE (WHERE status = the expected
one), so two racing requests cannot both win. The worker's side is elsewhere:
its lease and how a run ends (job_lease.py), what a run records (job_records.py),
retries and the reconciler's sweeps (job_recovery.py).

    validating_files -> queued -> running -> succeeded | failed | cancelled
    queued | running -> paused -> queued          (pause / resume)
    running -> queued                              (lease expired or a transient error: retried after
                                                    a backoff; a graceful worker shutdown: at once)
"""

from __future__ import annotations

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from service.db.models import Checkpoint, Job, JobEvent, JobMetric, Project, now
from service.repositories.pagination import Page, paginate

LIVE = ("validating_files", "queued", "running", "paused")
ACTIVE = ("validating_files", "queued", "running")  # what counts against a project's quota (paused does not)
TERMINAL = ("succeeded", "failed", "cancelled")


class IllegalTransition(Exception):
    def __init__(self, job: Job, action: str):
        super().__init__(f"job {job.id} is {job.status}; it cannot be {action}")
        self.job, self.action = job, action


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


def checkpoint_at_step(session: Session, job_id: str, step: int) -> Checkpoint | None:
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))


def project_checkpoint_and_job(session: Session, project_id: str,
                               checkpoint_id: str) -> tuple[Checkpoint, Job] | None:
    """A checkpoint of any job of the project, with its job."""
    row = session.execute(select(Checkpoint, Job).join(Job, Job.id == Checkpoint.job_id)
                          .where(Checkpoint.id == checkpoint_id, Job.project_id == project_id)).first()
    return None if row is None else (row[0], row[1])


def with_model(session: Session, project_id: str, job_id: str) -> Job | None:
    """A job of the project whose fine-tuned model was not deleted, in any status: its model and checkpoints
    may be named while it runs, and after it failed."""
    return session.scalar(select(Job).where(Job.project_id == project_id, Job.id == job_id,
                                            Job.model_deleted_at.is_(None)))


def trained_on(session: Session, project_id: str, base_model: str) -> bool:
    """Whether any job of the project names this base model."""
    return session.scalar(select(Job.id).where(Job.project_id == project_id, Job.model == base_model)
                          .limit(1)) is not None


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
