"""Cursor pages (service/repositories/pagination.py) as the list routes use them: newest first, or oldest first for
files; `after` excludes the cursor's row; has_more only when a further row exists; a cursor the caller may not see
is unknown."""

from __future__ import annotations

import pytest

from service.db.models import File
from service.db.session import session_factory
from service.repositories import files, projects
from service.repositories.pagination import UnknownCursor


@pytest.fixture
def listed(database_url):
    """(sessions, project id, its five file ids oldest first, another project's file id)."""
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))

        def add(project_id: str, name: str) -> str:
            return files.add(s, File(project_id=project_id, filename=name, purpose="fine-tune", bytes=1,
                                     sha256="0" * 64, rows=1, storage_key=name)).id

        ids = [add(own, f"f{i}") for i in range(5)]
        foreign = add(other, "theirs")
    return sessions, own, ids, foreign


def _page(sessions, project_id, **kw):
    kw = {"after": None, "purpose": None, "ascending": False, **kw}
    with sessions() as s:
        page = files.page(s, project_id, **kw)
        return [f.id for f in page.items], page.has_more


def test_pages_newest_first_and_oldest_first(listed):
    sessions, own, ids, _ = listed
    newest = ids[::-1]
    assert _page(sessions, own, limit=2) == (newest[:2], True)
    assert _page(sessions, own, limit=2, after=newest[1]) == (newest[2:4], True)
    assert _page(sessions, own, limit=2, after=newest[3]) == (newest[4:], False)
    assert _page(sessions, own, limit=2, ascending=True) == (ids[:2], True)
    assert _page(sessions, own, limit=2, ascending=True, after=ids[1]) == (ids[2:4], True)
    assert _page(sessions, own, limit=2, ascending=True, after=ids[3]) == (ids[4:], False)


def test_a_page_that_holds_the_last_row_has_no_more(listed):
    sessions, own, ids, _ = listed
    assert _page(sessions, own, limit=5) == (ids[::-1], False)
    assert _page(sessions, own, limit=4, ascending=True, after=ids[0]) == (ids[1:], False)


def test_a_cursor_of_another_project_is_unknown_and_named(listed):
    sessions, own, _, foreign = listed
    with pytest.raises(UnknownCursor) as unknown:
        _page(sessions, own, limit=2, after=foreign)
    assert unknown.value.args == (foreign,)
