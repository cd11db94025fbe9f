"""Project secrets: written once, used by the worker, never shown again.

A secret holds e.g. the Authorization header value of a remote reward
endpoint. Jobs and reward specs name a secret; the worker reads its value
when a job starts. No endpoint returns a value, and names are unique per
project: to rotate a secret, delete it and create it again (a job reads the
value at its next start).
"""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import Secret
from service.errors import Conflict, NotFound
from service.repositories import secrets as secrets_repo
from service.schemas.scoring_api import SecretCreate, SecretObject


def present(row: Secret) -> SecretObject:
    return SecretObject(id=row.id, name=row.name, created_at=row.created_at)


def create(session: Session, project_id: str, body: SecretCreate) -> Secret:
    conflict = Conflict(f"a secret named {body.name!r} already exists in this project; delete it first to "
                        "replace it", param="name", code="secret_exists")
    if secrets_repo.get_by_name(session, project_id, body.name) is not None:
        raise conflict
    try:
        with session.begin_nested():
            return secrets_repo.add(session, Secret(project_id=project_id, name=body.name, value=body.value))
    except IntegrityError:  # a concurrent create with the same name won
        raise conflict from None


def delete(session: Session, project_id: str, secret_id: str) -> Secret:
    row = secrets_repo.get(session, project_id, secret_id)
    if row is None:
        raise NotFound(f"no such secret: {secret_id}", param="secret_id")
    secrets_repo.delete(session, row)
    return row
