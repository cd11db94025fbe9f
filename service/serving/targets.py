"""Which weights a request's `model` names, for the caller's project: a base model, or a base plus a checkpoint.

Fine-tuned models and their checkpoints are named as a job's `model` names
them (service/models/start.py): `ft:...` (the final checkpoint),
`ft:...:ckpt-step-N` (any kept checkpoint) or a checkpoint id. Another
project's are 404s, like ids that do not exist.

A base model is served as it is when the operator lists it
(CISPO_SERVE_BASE_MODELS) or when one of the project's own jobs trained on
it, so a project can compare its fine-tuned model with where it started
(service/models/known_bases.py, which eval runs share); anything else is a
404, never a download of whatever hub id was asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.errors import InvalidRequest, NotFound
from service.models import known_bases, start
from service.repositories import jobs as jobs_repo
from service.settings import Settings


@dataclass(frozen=True)
class Target:
    base: str
    checkpoint: dict | None  # {"id", "prefix", "files"}: a LoRA adapter to apply; None: the base as it is

    def wire(self) -> dict:
        return {"base": self.base, "checkpoint": self.checkpoint}


def resolve(session: Session, project_id: str, model: str, settings: Settings) -> Target:
    if start.names_a_start(model):
        found = start.resolve(session, project_id, model)  # NotFound (param model) outside the project
        if found.lora is None:
            raise InvalidRequest(f"model: {model!r} is a full fine-tune; serving applies LoRA adapters only "
                                 "(download its checkpoint to serve the whole model yourself)",
                                 param="model", code="model_not_servable")
        ckpt = jobs_repo.checkpoint(session, found.source_job_id, found.checkpoint_id)
        return Target(found.base_model, {"id": ckpt.id, "prefix": ckpt.storage_prefix, "files": dict(ckpt.files)})
    if known_bases.listed_or_trained_on(session, project_id, model, settings):
        return Target(model, None)
    raise NotFound(f"model: no model {model!r} is served to this project (GET /v1/models lists its fine-tuned "
                   "models; a base model is served when the operator lists it in CISPO_SERVE_BASE_MODELS or "
                   "one of the project's jobs trained on it)", param="model", code="model_not_found")
