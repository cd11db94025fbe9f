"""What a job's evidence needs from SQL: its reward curve so far, and where its forecast and best checkpoint go.

Worker writes are fenced by the lease epoch like every other (service/repositories/job_lease.py). The curve is
read back from the recorded metrics rather than kept in the worker's memory, so a resumed run (another
worker, after a crash) forecasts and stops on the same history (job_history.rewind keeps it one run).
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db.models import Checkpoint, Job, JobMetric
from service.repositories.job_history import TOKENS
from service.repositories.job_lease import fenced

CURVE_METRICS = ("reward_mean", "eval_reward_mean", "eval_reward_ci_low", "eval_reward_ci_high", TOKENS)


def curve(session: Session, job_id: str) -> dict[int, dict[str, float]]:
    """step -> the metrics a forecast and the stop rule read (train reward, eval and its interval, tokens)."""
    by_step: dict[int, dict[str, float]] = {}
    for step, name, value in session.execute(
            select(JobMetric.step, JobMetric.name, JobMetric.value)
            .where(JobMetric.job_id == job_id, JobMetric.name.in_(CURVE_METRICS)).order_by(JobMetric.step)):
        by_step.setdefault(step, {})[name] = value
    return by_step


def set_forecast(session: Session, job_id: str, epoch: int, forecast: dict) -> bool:
    result = session.execute(update(Job).where(fenced(job_id, epoch)).values(forecast=forecast)
                             .execution_options(synchronize_session=False))
    return result.rowcount == 1


def eval_score(metrics: dict | None) -> float | None:
    """How good a checkpoint's eval was (higher is better): its mean reward, else minus its eval loss (a
    supervised job without a reward); None without an eval."""
    metrics = metrics or {}
    if "eval_reward_mean" in metrics:
        return float(metrics["eval_reward_mean"])
    if "eval_loss" in metrics:
        return -float(metrics["eval_loss"])
    return None


def best_checkpoint(session: Session, job_id: str) -> Checkpoint | None:
    """The job's kept checkpoint with the best eval (the earliest of equals: it got there with less training)."""
    best, best_score = None, None
    for ckpt in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)):
        score = eval_score(ckpt.metrics)
        if score is not None and (best_score is None or score > best_score):
            best, best_score = ckpt, score
    return best


def set_best_checkpoint(session: Session, job_id: str, epoch: int, checkpoint_id: str | None) -> bool:
    result = session.execute(update(Job).where(fenced(job_id, epoch)).values(best_checkpoint_id=checkpoint_id)
                             .execution_options(synchronize_session=False))
    return result.rowcount == 1
