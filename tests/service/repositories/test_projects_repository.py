"""Projects and their API keys through the repository (service/repositories/projects.py): a key is stored as its
sha256 only, found while unrevoked, touched at most once per resolution, listed oldest first, revoked once."""

from __future__ import annotations

import hashlib

import pytest

from service.db.models import ApiKey
from service.db.session import session_factory
from service.repositories import projects


@pytest.fixture
def sessions(database_url):
    return session_factory(database_url)


def test_hash_key_is_the_hex_sha256_of_the_key():
    assert projects.hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert projects.hash_key("sk-cispo-é") == hashlib.sha256("sk-cispo-é".encode()).hexdigest()


def test_a_project_is_made_once_per_name(sessions):
    with sessions.begin() as s:
        made = projects.get_or_create_project(s, "alpha")
        assert made.id.startswith("proj_") and made.name == "alpha"  # flushed: the id exists already
        again = projects.get_or_create_project(s, "alpha")
        other = projects.get_or_create_project(s, "beta")
    assert again.id == made.id and other.id != made.id and other.name == "beta"


def test_a_new_key_is_stored_as_its_hash_with_a_short_prefix(sessions):
    with sessions.begin() as s:
        project = projects.get_or_create_project(s, "alpha")
        key, second = projects.create_key(s, project), projects.create_key(s, project)
        rows = s.query(ApiKey).order_by(ApiKey.seq).all()
    assert key.startswith(projects.KEY_PREFIX) and len(key) == len(projects.KEY_PREFIX) + 43  # 32 random bytes
    assert second != key and len(rows) == 2
    assert rows[0].sha256 == projects.hash_key(key) and rows[0].prefix == key[:len(projects.KEY_PREFIX) + 4]
    assert rows[0].project_id == project.id and key not in (rows[0].sha256, rows[0].prefix)


def test_active_key_finds_an_unrevoked_key_and_its_project(sessions):
    with sessions.begin() as s:
        alpha, beta = projects.get_or_create_project(s, "alpha"), projects.get_or_create_project(s, "beta")
        a_key, b_key = projects.create_key(s, alpha), projects.create_key(s, beta)
    with sessions() as s:
        row, project = projects.active_key(s, a_key)
        assert (row.sha256, project.name) == (projects.hash_key(a_key), "alpha")
        assert projects.active_key(s, b_key)[1].name == "beta"
        assert projects.active_key(s, "sk-cispo-unknown") is None
        assert projects.active_key(s, projects.hash_key(a_key)) is None  # the stored hash is no key
    with sessions.begin() as s:
        projects.revoke(s, row.id)
    with sessions() as s:
        assert projects.active_key(s, a_key) is None and projects.active_key(s, b_key) is not None


def test_touch_key_writes_a_use_only_when_the_last_is_older_than_the_bound(sessions):
    with sessions.begin() as s:
        project = projects.get_or_create_project(s, "alpha")
        projects.create_key(s, project), projects.create_key(s, project)
        one, two = (k.id for k, _ in projects.keys(s))

    def touch(key_id: str, t: int, older_than: int) -> dict[str, int | None]:
        with sessions.begin() as s:
            projects.touch_key(s, key_id, t, older_than=older_than)
        with sessions() as s:
            return {k.id: k.last_used_at for k, _ in projects.keys(s)}

    assert touch(one, 100, older_than=40) == {one: 100, two: None}  # never used: written
    assert touch(one, 150, older_than=99) == {one: 100, two: None}  # used since the bound: kept
    assert touch(one, 160, older_than=100) == {one: 160, two: None}  # used at the bound: written
    assert touch(two, 170, older_than=110) == {one: 160, two: 170}


def test_keys_are_listed_oldest_first_with_their_project_or_of_one_project(sessions):
    with sessions.begin() as s:
        alpha, beta = projects.get_or_create_project(s, "alpha"), projects.get_or_create_project(s, "beta")
        made = [(projects.create_key(s, p), p.name) for p in (beta, alpha, beta, alpha)]
    with sessions.begin() as s:  # rewrites the oldest key's row (PostgreSQL: a new row version, last in the table)
        projects.touch_key(s, projects.active_key(s, made[0][0])[0].id, 5, older_than=0)
    with sessions() as s:
        listed = [(k.sha256, name) for k, name in projects.keys(s)]
        of_beta = [(k.sha256, name) for k, name in projects.keys(s, "beta")]
        assert projects.keys(s, "gamma") == []
    assert listed == [(projects.hash_key(key), name) for key, name in made]
    assert of_beta == [(projects.hash_key(key), name) for key, name in made if name == "beta"]


def test_revoke_stamps_a_key_once_and_answers_none_for_an_unknown_id(sessions, monkeypatch):
    with sessions.begin() as s:
        project = projects.get_or_create_project(s, "alpha")
        projects.create_key(s, project), projects.create_key(s, project)
        first, second = (k.id for k, _ in projects.keys(s))
    monkeypatch.setattr(projects, "now", lambda: 1000)
    with sessions.begin() as s:
        assert projects.revoke(s, first).revoked_at == 1000
    monkeypatch.setattr(projects, "now", lambda: 2000)
    with sessions.begin() as s:
        assert projects.revoke(s, first).revoked_at == 1000  # already revoked: the first time stays
        assert projects.revoke(s, "key_none") is None
    with sessions() as s:
        assert {k.id: k.revoked_at for k, _ in projects.keys(s)} == {first: 1000, second: None}
