"""Liveness of the database, for the readiness probe."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session


def ping(session: Session) -> None:
    session.execute(select(1)).one()
