"""Uploaded dataset files."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import File
from service.repositories.pagination import Page, paginate


def add(session: Session, file: File) -> File:
    session.add(file)
    session.flush()
    return file


def get(session: Session, project_id: str, file_id: str) -> File | None:
    return session.scalar(select(File).where(File.project_id == project_id, File.id == file_id))


def page(session: Session, project_id: str, *, after: str | None, limit: int, purpose: str | None,
         ascending: bool, sha256: str | None = None) -> Page[File]:
    """A page of the project's files; with `sha256`, only those with that content (a client reuses one instead
    of uploading the same bytes again)."""
    stmt = select(File).where(File.project_id == project_id)
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    if sha256:
        stmt = stmt.where(File.sha256 == sha256)
    return paginate(session, stmt, File, after=after, limit=limit, ascending=ascending)


def delete(session: Session, file: File) -> None:
    session.delete(file)
    session.flush()


def rows_by_id(session: Session, project_id: str, file_ids: list[str]) -> dict[str, int]:
    """Row counts of the given files (those that still exist), in one query."""
    if not file_ids:
        return {}
    stmt = select(File.id, File.rows).where(File.project_id == project_id, File.id.in_(set(file_ids)))
    return dict(session.execute(stmt).tuples().all())
