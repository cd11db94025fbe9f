"""Projects and their API keys (stored as sha256 only; shown once)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from service.db.models import ApiKey, Project, now

KEY_PREFIX = "sk-cispo-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_project(session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        project = Project(name=name)
        session.add(project)
        session.flush()
    return project


def name_of(session: Session, project_id: str) -> str | None:
    return session.scalar(select(Project.name).where(Project.id == project_id))


def create_key(session: Session, project: Project) -> str:
    """A new key for the project; the plain key exists only in the return value."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(project_id=project.id, sha256=hash_key(key), prefix=key[: len(KEY_PREFIX) + 4]))
    session.flush()
    return key


def active_key(session: Session, key: str) -> tuple[ApiKey, Project] | None:
    """The unrevoked key row and its project, in one query (read-only)."""
    digest = hash_key(key)
    row = session.execute(select(ApiKey, Project).join(Project, Project.id == ApiKey.project_id)
                          .where(ApiKey.sha256 == digest, ApiKey.revoked_at.is_(None))).first()
    # The lookup is by hash, so timing reveals nothing about the key; compare anyway as defence in depth.
    if row is None or not hmac.compare_digest(row[0].sha256, digest):
        return None
    return row[0], row[1]


def touch_key(session: Session, key_id: str, t: int, *, older_than: int) -> None:
    """Record use, unless a concurrent request already did within the resolution."""
    session.execute(update(ApiKey).where(ApiKey.id == key_id, or_(ApiKey.last_used_at.is_(None),
                                                                  ApiKey.last_used_at <= older_than))
                    .values(last_used_at=t))


def keys(session: Session, project_name: str | None = None) -> list[tuple[ApiKey, str]]:
    """(key row, project name), oldest first; optionally of one project."""
    stmt = select(ApiKey, Project.name).join(Project, Project.id == ApiKey.project_id)
    if project_name is not None:
        stmt = stmt.where(Project.name == project_name)
    return [(k, name) for k, name in session.execute(stmt.order_by(ApiKey.seq))]


def revoke(session: Session, key_id: str) -> ApiKey | None:
    """Revoke a key by id (as `cispo keys list` shows it); None if there is no such key."""
    row = session.scalar(select(ApiKey).where(ApiKey.id == key_id))
    if row is not None and row.revoked_at is None:
        row.revoked_at = now()
        session.flush()
    return row
