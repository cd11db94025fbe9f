"""Cursor pages over rows ordered by their integer seq, newest first (OpenAI's `after` / `has_more`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import Select
from sqlalchemy.orm import Session

T = TypeVar("T")


class UnknownCursor(LookupError):
    pass


@dataclass
class Page(Generic[T]):
    items: list[T]
    has_more: bool


def paginate(session: Session, stmt: Select, model, *, after: str | None, limit: int, ascending: bool = False) -> Page:
    """`stmt` selects `model` rows already filtered to what the caller may see."""
    seq = model.seq
    if after is not None:
        # Look the cursor up within what the caller may see, so another tenant's id is just unknown.
        cursor = session.scalar(stmt.with_only_columns(seq).where(model.id == after))
        if cursor is None:
            raise UnknownCursor(after)
        stmt = stmt.where(seq > cursor if ascending else seq < cursor)
    stmt = stmt.order_by(seq.asc() if ascending else seq.desc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return Page(items=rows[:limit], has_more=len(rows) > limit)
