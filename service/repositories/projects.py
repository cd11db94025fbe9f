"""Projects and their API keys (stored as sha256 only; shown once)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select
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


def create_key(session: Session, project: Project) -> str:
    """A new key for the project; the plain key exists only in the return value."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(project_id=project.id, sha256=hash_key(key), prefix=key[: len(KEY_PREFIX) + 4]))
    session.flush()
    return key


def project_for_key(session: Session, key: str) -> Project | None:
    digest = hash_key(key)
    row = session.scalar(select(ApiKey).where(ApiKey.sha256 == digest, ApiKey.revoked_at.is_(None)))
    # The lookup is by hash, so timing reveals nothing about the key; compare anyway as defence in depth.
    if row is None or not hmac.compare_digest(row.sha256, digest):
        return None
    row.last_used_at = now()
    return session.scalar(select(Project).where(Project.id == row.project_id))
