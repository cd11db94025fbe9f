"""A job's record of its steps (metrics, samples, step-tagged events) reads as one run, however many runs it took.

A run that dies (a crash, a lost lease, an outage) may have recorded steps past
its newest committed checkpoint; the next run resumes from that checkpoint and
does those steps again. So a new lease first forgets what was recorded after
the checkpoint (`rewind`), and the re-run records them afresh: one "Step N"
event per step, the re-run's metrics and samples, and a `trained_tokens` that
counts each step once. The job's counter always equals the sum of its steps'
`trained_tokens` metric (record_step keeps it so), which is how it is rebuilt.
"""

from __future__ import annotations

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from service.db.models import Checkpoint, Job, JobEvent, JobMetric, JobSample

TOKENS = "trained_tokens"  # the per-step metric the job's trained_tokens sums


def committed_step(session: Session, job_id: str) -> int | None:
    """The step of the newest committed checkpoint, the one a run resumes from (None: it starts afresh)."""
    return session.scalar(select(func.max(Checkpoint.step)).where(Checkpoint.job_id == job_id))


def rewind(session: Session, job_id: str) -> int:
    """Forget every step recorded after the newest committed checkpoint and rebuild the job's counters from
    what is left; returns the step the next run starts after. Call under the new lease (the claim's UPDATE
    holds the row), before the run records anything."""
    resumes_at = committed_step(session, job_id)
    # Without a checkpoint the run starts at step 0 and evaluates there again, so nothing is kept.
    keep_to = -1 if resumes_at is None else resumes_at
    session.execute(delete(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > keep_to)
                    .execution_options(synchronize_session=False))
    session.execute(delete(JobSample).where(JobSample.job_id == job_id, JobSample.step > keep_to)
                    .execution_options(synchronize_session=False))
    # Step, evaluation and reward-error events carry their step in data; the story events (started, failed,
    # resumed) carry none and stay.
    session.execute(delete(JobEvent).where(JobEvent.job_id == job_id, JobEvent.data["step"].as_integer() > keep_to)
                    .execution_options(synchronize_session=False))
    tokens = session.scalar(select(func.coalesce(func.sum(JobMetric.value), 0.0))
                            .where(JobMetric.job_id == job_id, JobMetric.name == TOKENS))
    session.execute(update(Job).where(Job.id == job_id)
                    .values(steps_done=max(keep_to, 0), trained_tokens=int(round(tokens)))
                    .execution_options(synchronize_session=False))
    return max(keep_to, 0)


def step_tokens(session: Session, job_id: str, step: int) -> int:
    """What a step already recorded added to the job's trained_tokens (0 if it was not recorded)."""
    value = session.scalar(select(JobMetric.value).where(JobMetric.job_id == job_id, JobMetric.step == step,
                                                         JobMetric.name == TOKENS))
    return int(round(value or 0))
