"""Continuing training: which checkpoint of this project a job's `model` names as its starting point.

OpenAI's convention is to fine-tune a fine-tuned model by naming it as the
job's `model`. Three forms are accepted:

    ft:<base>:<project>:<suffix>:<job id>                  the job's final checkpoint (GET /v1/models)
    ft:<base>:<project>:<suffix>:<job id>:ckpt-step-<N>    that checkpoint (a checkpoint's fine_tuned_model_checkpoint)
    ftckpt_...                                             that checkpoint, by its id

The new job trains the same base model from the checkpoint's weights, and
pins those weights as its reference policy (the spec's `init_from`, which a
service job sets to the checkpoint id; the worker downloads it). Lookups are
scoped to the caller's project, so another project's model is a 404 like a
model that does not exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.db.models import Job
from service.errors import NotFound
from service.models import fine_tuned
from service.repositories import jobs as jobs_repo
from service.repositories import projects

_CHECKPOINT_SUFFIX = re.compile(r"^(?P<model>ft:.+):ckpt-step-(?P<step>\d+)$")


@dataclass(frozen=True)
class Start:
    checkpoint_id: str
    base_model: str  # the source job's base model (a hub id or an allowed directory)
    lora: dict | None  # the source job's adapter spec; None: it trained every weight
    source_job_id: str


def names_a_start(model: str) -> bool:
    """Whether `model` names a fine-tuned model or checkpoint rather than a base model."""
    return model.startswith(("ft:", "ftckpt_"))


def _not_found(model: str) -> NotFound:
    return NotFound(f"model: no fine-tuned model or checkpoint {model!r} in this project (GET /v1/models lists "
                    "its fine-tuned models, GET /v1/fine_tuning/jobs/{id}/checkpoints their checkpoints)",
                    param="model", code="model_not_found")


def _job_of(session: Session, project_id: str, model: str) -> Job | None:
    """The job a model id names (any status, so a checkpoint of a running or failed job counts), whole id matched."""
    job = jobs_repo.with_model(session, project_id, model.rsplit(":", 1)[-1])
    if job is None or fine_tuned.model_id(job, projects.name_of(session, project_id)) != model:
        return None
    return job


def resolve(session: Session, project_id: str, model: str) -> Start:
    """The checkpoint `model` starts from; NotFound (param 'model') for anything not in this project."""
    if model.startswith("ftckpt_"):
        row = jobs_repo.project_checkpoint_and_job(session, project_id, model)
        if row is None:
            raise _not_found(model)
        checkpoint, job = row
    elif m := _CHECKPOINT_SUFFIX.match(model):
        job = _job_of(session, project_id, m["model"])
        checkpoint = job and jobs_repo.checkpoint_at_step(session, job.id, int(m["step"]))
    else:
        job = _job_of(session, project_id, model)
        if job is not None and job.status != "succeeded":
            raise NotFound(f"model: {model!r} names job {job.id}, which has not succeeded (status {job.status}); "
                           "name one of its checkpoints to start from it", param="model", code="model_not_found")
        checkpoint = job and jobs_repo.latest_checkpoint(session, job.id)
    if job is None or checkpoint is None:
        raise _not_found(model)
    return Start(checkpoint_id=checkpoint.id, base_model=job.spec["model"], lora=job.spec.get("lora"),
                 source_job_id=job.id)
