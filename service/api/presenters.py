"""ORM rows -> public API objects. The only place that knows both shapes."""

from __future__ import annotations

import math
from typing import Any

from service.auth import Principal
from service.db.models import Checkpoint, File, Job, JobEvent, JobMetric, JobSample, RewardFunction
from service.job_spec.build import public_hyperparameters
from service.models import fine_tuned
from service.repositories.job_outputs import sample_id
from service.repositories.pagination import Page
from service.schemas.api import (
    CheckpointObject,
    EventObject,
    FileObject,
    JobError,
    JobObject,
    ListObject,
    MetricPoint,
    RewardFunctionObject,
    SampleObject,
)
from service.schemas.model_api import ModelObject
from service.storage_layout import MERGED_ARCHIVE


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity; a diverged metric is reported as null instead of failing the response."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def page(items: list, has_more: bool) -> ListObject:
    ids = [getattr(i, "id", None) for i in items]
    return ListObject(data=items, has_more=has_more, first_id=ids[0] if ids else None,
                      last_id=ids[-1] if ids else None)


def file(row: File) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=row.created_at, filename=row.filename,
                      purpose=row.purpose, sha256=row.sha256)


def reward_function(row: RewardFunction) -> RewardFunctionObject:
    return RewardFunctionObject(id=row.id, name=row.name, type=row.spec.get("type", ""),
                                created_at=row.created_at, spec=row.spec)


def model_name(job: Job, who: Principal) -> str:
    return fine_tuned.model_id(job, who.project_name)


def job(row: Job, who: Principal, training_rows: int | None, queue_position: int | None = None) -> JobObject:
    error = None
    if row.error_code:
        error = JobError(code=row.error_code, message=row.error_message or "", param=row.error_param)
    return JobObject(
        id=row.id, model=row.model, created_at=row.created_at, finished_at=row.finished_at,
        fine_tuned_model=model_name(row, who) if row.status == "succeeded" else None,
        organization_id=row.project_id, status=row.status, validation_file=row.validation_file,
        queue_position=queue_position if row.status == "queued" else None,
        training_file=row.training_file, trained_tokens=row.trained_tokens, error=error, seed=row.seed,
        metadata=row.metadata_, user_provided_suffix=row.suffix,
        hyperparameters=public_hyperparameters(row.spec, training_rows), method=row.method,
        steps_done=row.steps_done, total_steps=row.total_steps, reward_function=row.reward_function_id,
        environment=row.environment_id,
        estimated_finish=row.estimated_finish if row.status == "running" else None,
        result_files=[f for f in (row.result_file_id, row.tensorboard_file_id) if f],
        integrations=row.spec.get("integrations", []),
        forecast=finite(row.forecast) if row.forecast else None, best_checkpoint=row.best_checkpoint_id,
    )


def jobs(rows: Page[Job], who: Principal, training_rows: dict[str, int], queue_positions: dict[str, int]) -> ListObject:
    return page([job(r, who, training_rows.get(r.training_file), queue_positions.get(r.id)) for r in rows.items],
                rows.has_more)


def event(row: JobEvent) -> EventObject:
    return EventObject(id=row.id, created_at=row.created_at, level=row.level, message=row.message,
                       type=row.type, data=finite(row.data))


def checkpoint_eval(metrics: dict[str, float]) -> dict | None:
    """The eval a checkpoint's step recorded (worker/trainer/evaluation.py), as one object; None without one."""
    out: dict = {}
    if "eval_reward_mean" in metrics:
        out = {"mean": metrics["eval_reward_mean"], "n": int(metrics.get("eval_rows", 0)),
               "interval": [metrics.get("eval_reward_ci_low"), metrics.get("eval_reward_ci_high")]}
        if "eval_reward_diff" in metrics:
            out["difference_to_baseline"] = {"mean": metrics["eval_reward_diff"],
                                             "interval": [metrics.get("eval_reward_diff_ci_low"),
                                                          metrics.get("eval_reward_diff_ci_high")]}
    if "eval_loss" in metrics:
        out["loss"] = metrics["eval_loss"]
    return finite(out) or None


def checkpoint(row: Checkpoint, job_row: Job, who: Principal) -> CheckpointObject:
    metrics = row.metrics or {}
    return CheckpointObject(
        id=row.id, created_at=row.created_at,
        fine_tuned_model_checkpoint=f"{model_name(job_row, who)}:ckpt-step-{row.step}",
        fine_tuning_job_id=row.job_id, step_number=row.step, metrics=finite(metrics),
        eval=checkpoint_eval(metrics),
        merged_model=MERGED_ARCHIVE in (row.files or {}),
    )


def metric(row: JobMetric) -> MetricPoint:
    return MetricPoint(step=row.step, name=row.name, value=finite(row.value))


def model(row: Job, who: Principal) -> ModelObject:
    return ModelObject(id=model_name(row, who), created=row.finished_at or row.created_at, owned_by=row.project_id,
                       root=row.model, fine_tuning_job_id=row.id)


def sample(row: JobSample) -> SampleObject:
    return SampleObject(id=sample_id(row), step=row.step, prompt=row.prompt, completion=row.completion,
                        reward=finite(row.reward), advantage=finite(row.advantage), rewards=finite(row.rewards or {}),
                        created_at=row.created_at)
