"""/v1/environments (ours): register a multi-turn environment once, reference it from many jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service import environments as env_service
from service.api import presenters
from service.api.deps import PrincipalDep, SessionDep, SettingsDep
from service.db.models import Environment
from service.repositories import environments as env_repo
from service.schemas.api import Deleted, ListObject
from service.schemas.environment_api import EnvironmentCreate, EnvironmentObject

router = APIRouter(prefix="/v1/environments", tags=["environments"])


def present(row: Environment) -> EnvironmentObject:
    return EnvironmentObject(id=row.id, name=row.name, type=row.spec.get("type", ""), created_at=row.created_at,
                             spec=row.spec)


@router.post("", response_model=EnvironmentObject)
def create_environment(body: EnvironmentCreate, session: SessionDep, who: PrincipalDep,
                       settings: SettingsDep) -> EnvironmentObject:
    row = env_service.create(session, who.project_id, body, settings=settings)
    session.commit()
    return present(row)


@router.get("", response_model=ListObject[EnvironmentObject])
def list_environments(session: SessionDep, who: PrincipalDep, after: str | None = None,
                      limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    rows = env_repo.page(session, who.project_id, after=after, limit=limit)
    return presenters.page([present(r) for r in rows.items], rows.has_more)


@router.get("/{environment_id}", response_model=EnvironmentObject)
def get_environment(environment_id: str, session: SessionDep, who: PrincipalDep) -> EnvironmentObject:
    return present(env_service.get(session, who.project_id, environment_id))


@router.delete("/{environment_id}", response_model=Deleted)
def delete_environment(environment_id: str, session: SessionDep, who: PrincipalDep) -> Deleted:
    row = env_service.delete(session, who.project_id, environment_id)
    session.commit()
    return Deleted(id=row.id, object="environment")
