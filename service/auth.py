"""API-key authentication: `Authorization: Bearer <key>` -> the project every route is scoped to.

It runs before the request body is read (service/api/access.py), so an
unauthenticated caller cannot make the API read, parse or store anything.
The lookup is a read; the key's last_used_at is written at most once a
minute, so pollers do not turn every GET into a write. Revocation needs no
cache invalidation: every request looks the key up.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from service.db.models import now
from service.errors import ServiceError
from service.repositories import projects

LAST_USED_RESOLUTION_S = 60


class Unauthenticated(ServiceError):
    status = 401
    code = "invalid_api_key"


@dataclass(frozen=True)
class Principal:
    """Who is calling: plain values, so nothing ORM-bound outlives the auth transaction."""

    project_id: str
    project_name: str
    key_id: str


def bearer_key(authorization: str | None) -> str:
    if not authorization:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
    return key


def authenticate(reads: sessionmaker[Session], writes: sessionmaker[Session], authorization: str | None) -> Principal:
    key = bearer_key(authorization)
    with reads() as session:
        found = projects.active_key(session, key)
    if found is None:
        # Never echo the key: it may be a real secret pasted into the wrong place.
        raise Unauthenticated("invalid API key")
    api_key, project = found
    t = now()
    if api_key.last_used_at is None or api_key.last_used_at <= t - LAST_USED_RESOLUTION_S:
        with writes.begin() as session:
            projects.touch_key(session, api_key.id, t, older_than=t - LAST_USED_RESOLUTION_S)
    return Principal(project_id=project.id, project_name=project.name, key_id=api_key.id)
