"""/v1/secrets (ours): values remote rewards need (auth headers), written once and never returned."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api import presenters
from service.api.deps import PrincipalDep, SessionDep, SettingsDep
from service.repositories import secrets as secrets_repo
from service.schemas.api import Deleted, ListObject
from service.schemas.scoring_api import SecretCreate, SecretObject
from service.secrets import store as secrets_service
from service.secrets.box import secret_box

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])


@router.post("", response_model=SecretObject)
def create_secret(body: SecretCreate, session: SessionDep, who: PrincipalDep, settings: SettingsDep) -> SecretObject:
    row = secrets_service.create(session, who.project_id, body, secret_box(settings))
    session.commit()
    return secrets_service.present(row)


@router.get("", response_model=ListObject[SecretObject])
def list_secrets(session: SessionDep, who: PrincipalDep, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    rows = secrets_repo.page(session, who.project_id, after=after, limit=limit)
    return presenters.page([secrets_service.present(r) for r in rows.items], rows.has_more)


@router.delete("/{secret_id}", response_model=Deleted)
def delete_secret(secret_id: str, session: SessionDep, who: PrincipalDep) -> Deleted:
    row = secrets_service.delete(session, who.project_id, secret_id)
    session.commit()
    return Deleted(id=row.id, object="secret")
