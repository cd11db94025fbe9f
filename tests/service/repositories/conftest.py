"""Fixtures of the repository tests."""

from __future__ import annotations

import pytest

from service.db.session import session_factory
from service.repositories import projects


@pytest.fixture
def two_projects(database_url):
    """(sessions, own project id, other project id)."""
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
    return sessions, own, other
