"""OpenAI's model object, for the project's fine-tuned models (GET/DELETE /v1/models)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ModelObject(BaseModel):
    id: str  # ft:<base>:<project>:<suffix>:<job id>, the job's fine_tuned_model
    object: Literal["model"] = "model"
    created: int
    owned_by: str  # the project id, as the job's organization_id
    root: str  # the base model
    fine_tuning_job_id: str


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True
