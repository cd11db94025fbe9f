"""Inserts that tolerate rows already there, in each dialect's spelling (PostgreSQL and SQLite both say ON
CONFLICT, through different insert constructs)."""

from __future__ import annotations

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def _insert(session: Session):
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


def insert_ignoring_duplicates(session: Session, model, rows: list[dict]) -> None:
    """Insert rows; a row that clashes with one there (a unique key) is left out."""
    if not rows:
        return
    session.execute(_insert(session)(model).values(rows).on_conflict_do_nothing())


def upsert(session: Session, model, rows: list[dict], keys: list[str]) -> None:
    """Insert rows; a row that exists (same keys) takes the new values."""
    if not rows:
        return
    stmt = _insert(session)(model).values(rows)
    changed = {c: stmt.excluded[c] for c in rows[0] if c not in keys}
    session.execute(stmt.on_conflict_do_update(index_elements=keys, set_=changed))
