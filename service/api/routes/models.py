"""/v1/models: the project's fine-tuned models (succeeded jobs' adapters), in OpenAI's shapes."""

from __future__ import annotations

import logging
from typing import Annotated

from anyio import from_thread
from fastapi import APIRouter, Query

from service.api import presenters
from service.api.deps import PollCacheDep, PrincipalDep, SessionDep, StoreDep
from service.models import fine_tuned
from service.schemas.api import ListObject
from service.schemas.model_api import ModelDeleted, ModelObject

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ListObject[ModelObject])
def list_models(session: SessionDep, who: PrincipalDep, after: str | None = None,
                limit: Annotated[int, Query(ge=1, le=100)] = 100) -> ListObject:
    """Newest first; `after` is a model id from an earlier page."""
    after_job = after.rsplit(":", 1)[-1] if after else None
    rows = fine_tuned.list_models(session, who.project_id, after_job_id=after_job, limit=limit)
    return presenters.page([presenters.model(r, who) for r in rows.items], rows.has_more)


@router.get("/{model:path}", response_model=ModelObject)
def get_model(model: str, session: SessionDep, who: PrincipalDep) -> ModelObject:
    # {model:path}: a base model name may hold a slash (Qwen/Qwen2.5-0.5B), as OpenAI's ids may.
    return presenters.model(fine_tuned.get(session, who.project_id, who.project_name, model), who)


@router.delete("/{model:path}", response_model=ModelDeleted)
def delete_model(model: str, session: SessionDep, who: PrincipalDep, store: StoreDep,
                 cache: PollCacheDep) -> ModelDeleted:
    prefixes = fine_tuned.delete(session, who.project_id, who.project_name, model)
    session.commit()
    # The job object changed (no best checkpoint any more): the caller's next GET of it must see that.
    from_thread.run_sync(cache.forget, who.project_id, model.rsplit(":", 1)[-1])
    for prefix in prefixes:  # after the commit: a failure here leaves unreachable bytes, never a dangling row
        try:
            store.delete_prefix(prefix)
        except Exception:
            log.exception("model %s: could not delete checkpoint objects under %s", model, prefix)
    return ModelDeleted(id=model)
