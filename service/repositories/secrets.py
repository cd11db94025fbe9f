"""Project secrets: values that jobs may use (remote reward auth) and the API never returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Secret
from service.egress import BoundSecret
from service.repositories.pagination import Page, paginate

if TYPE_CHECKING:  # an annotation only: service/secrets/store.py imports this module
    from service.secrets.box import SecretBox


def add(session: Session, secret: Secret) -> Secret:
    session.add(secret)
    session.flush()
    return secret


def get(session: Session, project_id: str, secret_id: str) -> Secret | None:
    return session.scalar(select(Secret).where(Secret.project_id == project_id, Secret.id == secret_id))


def get_by_name(session: Session, project_id: str, name: str) -> Secret | None:
    return session.scalar(select(Secret).where(Secret.project_id == project_id, Secret.name == name))


def hosts(session: Session, project_id: str, names: Iterable[str]) -> dict[str, list[str]]:
    """name -> the hosts it is bound to, for the names the project has."""
    names = list(names)
    if not names:
        return {}
    rows = session.execute(select(Secret.name, Secret.hosts).where(Secret.project_id == project_id,
                                                                   Secret.name.in_(names)))
    return {name: list(bound) for name, bound in rows}


def values(session: Session, project_id: str, names: Iterable[str], box: SecretBox) -> dict[str, BoundSecret]:
    """name -> decrypted value, bound to its hosts, for the names the project has (the worker's read, at
    job start, and the reward tests')."""
    names = list(names)
    if not names:
        return {}
    rows = session.execute(select(Secret.name, Secret.ciphertext, Secret.hosts)
                           .where(Secret.project_id == project_id, Secret.name.in_(names)))
    return {name: BoundSecret(box.open(ciphertext), bound) for name, ciphertext, bound in rows}


def page(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[Secret]:
    return paginate(session, select(Secret).where(Secret.project_id == project_id), Secret, after=after, limit=limit)


def delete(session: Session, secret: Secret) -> None:
    session.delete(secret)
    session.flush()
