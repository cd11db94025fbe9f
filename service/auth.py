"""API-key authentication: `Authorization: Bearer <key>` -> the project every route is scoped to."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.errors import ServiceError
from service.repositories import projects


class Unauthenticated(ServiceError):
    status = 401
    code = "invalid_api_key"


@dataclass(frozen=True)
class Principal:
    """Who is calling: plain values, so nothing ORM-bound outlives the auth transaction."""

    project_id: str
    project_name: str


def authenticate(session: Session, authorization: str | None) -> Principal:
    if not authorization:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
    project = projects.project_for_key(session, key)
    if project is None:
        # Never echo the key: it may be a real secret pasted into the wrong place.
        raise Unauthenticated("invalid API key")
    return Principal(project_id=project.id, project_name=project.name)
