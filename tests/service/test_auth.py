"""API-key authentication on its own: the header's parsing, the once-a-minute last-use write, and the
principal cache's bounds (found by mutation testing, bench/mutate.py; the HTTP side is in tests/service/api)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from service import auth
from service.auth import Principal, PrincipalCache, Unauthenticated, authenticate, bearer_key
from service.db.models import ApiKey
from service.db.session import session_factory
from service.repositories import projects
from tests.conftest import make_database


@pytest.mark.parametrize("header, key", [("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER  abc  ", "abc"),
                                         ("Bearer a b", "a b")])
def test_a_bearer_header_gives_its_key(header, key):
    assert bearer_key(header) == key


@pytest.mark.parametrize("header, message", [(None, "missing API key"), ("", "missing API key"),
                                             ("Bearer", "malformed"), ("Bearer    ", "malformed"),
                                             ("Basic abc", "malformed"), ("Bearerabc", "malformed")])
def test_a_missing_or_malformed_header_is_401(header, message):
    with pytest.raises(Unauthenticated, match=f"^{message}") as info:  # the message leads with the cause
        bearer_key(header)
    assert info.value.status == 401 and info.value.code == "invalid_api_key"


@pytest.fixture
def keyed(tmp_path):
    url, drop = make_database("sqlite", tmp_path)
    sessions = session_factory(url)
    with sessions.begin() as s:
        project = projects.get_or_create_project(s, "alpha")
        key, project_id = projects.create_key(s, project), project.id
    yield sessions, key, project_id
    sessions.kw["bind"].dispose()
    drop()


class CountingWrites:
    """The write sessionmaker, counting the transactions authenticate opens."""

    def __init__(self, sessions):
        self.sessions, self.opened = sessions, 0

    def begin(self):
        self.opened += 1
        return self.sessions.begin()


def test_authenticate_finds_the_project_and_writes_last_use_at_most_once_a_minute(keyed, monkeypatch):
    sessions, key, project_id = keyed
    writes, t = CountingWrites(sessions), [1_000_000]
    monkeypatch.setattr(auth, "now", lambda: t[0])

    def last_used() -> int | None:
        with sessions() as s:
            return s.scalar(select(ApiKey.last_used_at))

    who = authenticate(sessions, writes, f"Bearer {key}")
    assert (who.project_id, who.project_name) == (project_id, "alpha") and who.key_id
    assert (writes.opened, last_used()) == (1, 1_000_000)
    t[0] += auth.LAST_USED_RESOLUTION_S - 1
    authenticate(sessions, writes, f"Bearer {key}")
    assert (writes.opened, last_used()) == (1, 1_000_000)  # within the minute: a read only
    t[0] += 1
    authenticate(sessions, writes, f"Bearer {key}")
    assert (writes.opened, last_used()) == (2, 1_000_000 + auth.LAST_USED_RESOLUTION_S)


def test_an_unknown_or_revoked_key_is_refused_without_echoing_it(keyed):
    sessions, key, _ = keyed
    with pytest.raises(Unauthenticated, match="^invalid API key$"):
        authenticate(sessions, sessions, "Bearer sk-cispo-unknown")
    with sessions.begin() as s:
        (row, _), = projects.keys(s, "alpha")
        projects.revoke(s, row.id)
    with pytest.raises(Unauthenticated) as info:
        authenticate(sessions, sessions, f"Bearer {key}")
    assert key not in str(info.value)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


WHO = Principal(project_id="p", project_name="alpha", key_id="k")


def test_the_principal_cache_keeps_a_key_for_ttl_after_its_lookup_began():
    clock = Clock()
    cache = PrincipalCache(1.0, clock=clock)
    assert cache.get("Bearer x") is None
    cache.put("Bearer x", WHO, looked_up_at=99.5)
    assert cache.get("Bearer x") == WHO and cache.get("Bearer y") is None and cache.get(None) is None
    clock.t = 100.49
    assert cache.get("Bearer x") == WHO
    clock.t = 100.5  # looked_up_at + ttl: gone
    assert cache.get("Bearer x") is None


def test_a_zero_ttl_caches_nothing():
    cache = PrincipalCache(0.0, clock=Clock())
    cache.put("Bearer x", WHO, looked_up_at=100.0)
    assert cache.get("Bearer x") is None and cache._found == {}


def test_a_full_cache_drops_only_expired_entries(monkeypatch):
    monkeypatch.setattr(auth, "MAX_CACHED_KEYS", 3)
    clock = Clock()
    cache = PrincipalCache(1.0, clock=clock)
    cache.put("Bearer old", WHO, looked_up_at=98.0)  # expired at 99
    cache.put("Bearer live", WHO, looked_up_at=99.9)
    cache.put("Bearer edge", WHO, looked_up_at=99.0)  # expires at 100.0, which is now: expired
    cache.put("Bearer new", WHO, looked_up_at=100.0)  # full: the expired ones go first
    assert len(cache._found) == 2
    assert cache.get("Bearer live") == WHO and cache.get("Bearer new") == WHO
    cache.put("Bearer more", WHO, looked_up_at=100.0)  # below the cap again: nothing is dropped
    assert len(cache._found) == 3
