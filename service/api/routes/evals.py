"""/v1/evals: score a model on a file with a reward, as its own object run by a worker (service/evals/runs.py);
create, list, retrieve and cancel, in the shapes of the fine-tuning job routes."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request

from service.evals import runs as evals_service
from service.api import presenters
from service.api.deps import PrincipalDep, SessionDep, SettingsDep, StoreDep
from service.db.models import EvalRun
from service.schemas.api import ListObject
from service.evals.request import EvalCreate, EvalObject

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/evals", tags=["evals"])


def present(row: EvalRun) -> EvalObject:
    result = row.result or None
    return EvalObject(
        id=row.id, status=row.status, model=row.model, checkpoint_id=row.checkpoint_id, file=row.file_id,
        reward=row.spec.get("reward"), created_at=row.created_at, started_at=row.started_at,
        finished_at=row.finished_at,
        result=presenters.finite({k: result[k] for k in ("mean", "interval", "method", "n")}) if result else None,
        result_counts={"total": result["n"], "errored": result["errors"]} if result else None,
        result_files=[row.result_file_id] if row.result_file_id else [],
        error={"code": row.error_code, "message": row.error_message} if row.error_code else None,
        metadata=row.metadata_)


@router.post("", response_model=EvalObject)
def create_eval(body: EvalCreate, request: Request, session: SessionDep, who: PrincipalDep, store: StoreDep,
                settings: SettingsDep) -> EvalObject:
    row = evals_service.create(session, store, who.project_id, body, settings=settings)
    session.commit()
    try:  # after commit: the worker must find the row; a lost message leaves it queued until the reconciler resends it
        request.app.state.enqueue_eval(row.id)
    except Exception:
        log.exception("could not enqueue eval run %s", row.id)
    return present(row)


@router.get("", response_model=ListObject[EvalObject])
def list_evals(session: SessionDep, who: PrincipalDep, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    rows = evals_service.list_runs(session, who.project_id, after=after, limit=limit)
    return presenters.page([present(r) for r in rows.items], rows.has_more)


@router.get("/{eval_id}", response_model=EvalObject)
def get_eval(eval_id: str, session: SessionDep, who: PrincipalDep) -> EvalObject:
    return present(evals_service.get(session, who.project_id, eval_id))


@router.post("/{eval_id}/cancel", response_model=EvalObject)
def cancel_eval(eval_id: str, session: SessionDep, who: PrincipalDep) -> EvalObject:
    row = evals_service.cancel(session, who.project_id, eval_id)
    public = present(row)
    session.commit()
    return public
