"""Project secrets: written once, used by the worker, never shown again.

A secret holds e.g. the Authorization header value of a remote reward
endpoint. Jobs and reward specs name a secret; the worker reads its value
when a job starts. No endpoint returns a value, and names are unique per
project: to rotate a secret, delete it and create it again (a job reads the
value at its next start). Values are stored encrypted (service/secrets/box.py)
and each secret is bound to the hosts it may be sent to: a spec that would
send it elsewhere is refused when registered (check_bindings), and the
worker refuses again at call time (service/egress.py, BoundSecret).
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import Secret
from service.egress import host_matches
from service.errors import Conflict, InvalidRequest, NotFound
from service.repositories import secrets as secrets_repo
from service.schemas.scoring_api import SecretCreate, SecretObject
from service.secrets.box import SecretBox


def present(row: Secret) -> SecretObject:
    return SecretObject(id=row.id, name=row.name, hosts=list(row.hosts), created_at=row.created_at)


def check_bindings(session: Session, project_id: str, uses: Iterable[tuple[str, str]], *, param: str) -> None:
    """`uses` are (secret name, URL it would be sent to); raise InvalidRequest naming `param` for a secret
    the project lacks or a URL host the secret is not bound to."""
    uses = list(uses)
    bound = secrets_repo.hosts(session, project_id, {name for name, _ in uses})
    for name, url in uses:
        if name not in bound:
            raise InvalidRequest(f"{param}: the spec needs the secret {name!r}, which this project does not have "
                                 "(create it with POST /v1/secrets)", param=param, code="unknown_secret")
        host = urlsplit(url).hostname or ""
        if not host_matches(host, bound[name]):
            raise InvalidRequest(f"{param}: the secret {name!r} may only be sent to {', '.join(bound[name])}, and "
                                 f"this spec would send it to {host!r}; create a secret bound to that host",
                                 param=param, code="secret_host_not_allowed")


def create(session: Session, project_id: str, body: SecretCreate, box: SecretBox) -> Secret:
    conflict = Conflict(f"a secret named {body.name!r} already exists in this project; delete it first to "
                        "replace it", param="name", code="secret_exists")
    if secrets_repo.get_by_name(session, project_id, body.name) is not None:
        raise conflict
    try:
        with session.begin_nested():
            return secrets_repo.add(session, Secret(project_id=project_id, name=body.name,
                                                    ciphertext=box.seal(body.value),
                                                    hosts=sorted({h.lower() for h in body.hosts})))
    except IntegrityError:  # a concurrent create with the same name won
        raise conflict from None


def delete(session: Session, project_id: str, secret_id: str) -> Secret:
    row = secrets_repo.get(session, project_id, secret_id)
    if row is None:
        raise NotFound(f"no such secret: {secret_id}", param="secret_id")
    secrets_repo.delete(session, row)
    return row
