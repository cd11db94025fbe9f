"""Base models a project may run as they are, without training: serving (service/serving/targets.py) and eval
runs (service/evals/runs.py) name them.

A hub id qualifies when the operator lists it (CISPO_SERVE_BASE_MODELS) or when one of the project's own
jobs trained on it, so a project can compare its fine-tuned model with where it started; a local directory
when it lies under the operator's model directories (CISPO_MODEL_DIRS, service/models/source.py). Anything
else is refused, never a download of whatever hub id was asked for.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.errors import InvalidRequest
from service.models.source import check_model
from service.repositories import jobs as jobs_repo
from service.settings import Settings


def listed_or_trained_on(session: Session, project_id: str, model: str, settings: Settings) -> bool:
    if model in settings.resolved_serve_base_models():
        return True
    return jobs_repo.trained_on(session, project_id, model)


def check_known_base(session: Session, project_id: str, model: str, settings: Settings, *, param: str) -> None:
    """InvalidRequest naming `param` unless `model` is an allowed local directory or a known hub base."""
    if model.startswith("/"):
        check_model(model, settings)  # under CISPO_MODEL_DIRS, or refused with the same words as for jobs
        return
    if not listed_or_trained_on(session, project_id, model, settings):
        raise InvalidRequest(f"{param}: {model!r} is not a base model this project may use as it is: name a "
                             "fine-tuned model (ft:...) or checkpoint of this project, a base one of its jobs "
                             "trained on, one the operator lists in CISPO_SERVE_BASE_MODELS, or an absolute path "
                             "under CISPO_MODEL_DIRS", param=param, code="model_not_found")
