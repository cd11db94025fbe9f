"""What a running job leaves for people to read: sample completions, its estimated finish, its result file.

Worker writes are fenced by the lease epoch like metrics (service/repositories/job_lease.py), and a repeated
write (a step re-run after a resume) replaces the earlier one, so the samples are those of the run that
counts (service/repositories/job_history.py).
"""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.db.models import File, Job, JobEvent, JobSample
from service.repositories.inserts import insert_ignoring_duplicates
from service.repositories.job_lease import fenced
from service.repositories.pagination import Page


def _owned(session: Session, job_id: str, epoch: int) -> bool:
    return session.scalar(select(Job.id).where(fenced(job_id, epoch))) is not None


# -- worker side -----------------------------------------------------------


def add_samples(session: Session, job_id: str, epoch: int, step: int, samples: list[dict]) -> bool:
    """Store a step's samples (dicts with prompt, completion, reward, advantage, rewards); False if the lease
    is lost."""
    if not _owned(session, job_id, epoch):
        return False
    session.execute(delete(JobSample).where(JobSample.job_id == job_id, JobSample.step == step)
                    .execution_options(synchronize_session=False))
    insert_ignoring_duplicates(session, JobSample, [
        {"job_id": job_id, "step": step, "slot": slot, **sample} for slot, sample in enumerate(samples)])
    return True


def set_estimated_finish(session: Session, job_id: str, epoch: int, when: int) -> bool:
    result = session.execute(update(Job).where(fenced(job_id, epoch)).values(estimated_finish=when)
                             .execution_options(synchronize_session=False))
    return result.rowcount == 1


def attach_result_file(session: Session, job_id: str, epoch: int, file: File,
                       column: str = "result_file_id") -> bool:
    """Add the result file's row and point the job at it (`column`: result_file_id, the metrics CSV, or
    tensorboard_file_id), while the lease is still ours."""
    if not _owned(session, job_id, epoch):
        return False
    session.add(file)
    session.flush()
    session.execute(update(Job).where(Job.id == job_id).values({column: file.id})
                    .execution_options(synchronize_session=False))
    return True


# -- API side --------------------------------------------------------------


def samples(session: Session, job_id: str, *, step: int | None, after: str | None, limit: int) -> Page[JobSample]:
    """Newest step first, in slot order within a step; `after` is the last sample's public id (see sample_id)."""
    stmt = select(JobSample).where(JobSample.job_id == job_id)
    if step is not None:
        stmt = stmt.where(JobSample.step == step)
    if after is not None:
        after_step, after_slot = parse_sample_id(after)
        stmt = stmt.where((JobSample.step < after_step)
                          | ((JobSample.step == after_step) & (JobSample.slot > after_slot)))
    rows = list(session.scalars(stmt.order_by(JobSample.step.desc(), JobSample.slot).limit(limit + 1)))
    return Page(items=rows[:limit], has_more=len(rows) > limit)


def event_seq(session: Session, job_id: str, event_id: str) -> int | None:
    """Where an event of this job stands in the stream (None if it is not one of this job's)."""
    return session.scalar(select(JobEvent.seq).where(JobEvent.job_id == job_id, JobEvent.id == event_id))


def events_since(session: Session, job_id: str, after_seq: int, *, include_metrics: bool,
                 limit: int) -> tuple[str | None, list[JobEvent]]:
    """(the job's status, its next events oldest first). The status is read first: the worker writes its
    final event with the terminal status, so a terminal status read here means every event is visible below."""
    status = session.scalar(select(Job.status).where(Job.id == job_id))
    stmt = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after_seq)
    if not include_metrics:
        stmt = stmt.where(JobEvent.type != "metrics")
    return status, list(session.scalars(stmt.order_by(JobEvent.seq).limit(limit)))


def sample_id(row: JobSample) -> str:
    """A stable public id: the (step, slot) pair is unique within the job."""
    return f"ftsample-{row.step}-{row.slot}"


def parse_sample_id(value: str) -> tuple[int, int]:
    """(step, slot) of a public sample id; ValueError if it is not one."""
    prefix, step, slot = value.split("-")
    if prefix != "ftsample" or not step.isdigit() or not slot.isdigit():
        raise ValueError(value)
    return int(step), int(slot)
