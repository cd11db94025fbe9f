"""Project secrets through the repository (service/repositories/secrets.py): every read is of one project's rows,
by id or by name, and the worker's read decrypts each value bound to its own hosts."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet

from service.db.models import Secret
from service.db.session import session_factory
from service.egress import BoundSecret
from service.repositories import projects, secrets
from service.secrets.box import SecretBox


@pytest.fixture
def stored(database_url):
    """(sessions, box, own project id, other project id, {(project, name): secret id})."""
    sessions = session_factory(database_url)
    box = SecretBox(Fernet.generate_key().decode())
    ids = {}
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
        for project_id, name, value, hosts in [(own, "a", "own-a", ["a.example.com"]),
                                               (own, "b", "own-b", ["b.example.com", "*.b.example.com"]),
                                               (other, "a", "other-a", ["elsewhere.example.com"])]:
            added = secrets.add(s, Secret(project_id=project_id, name=name, ciphertext=box.seal(value), hosts=hosts))
            assert added.id.startswith("secret-")  # flushed: the id exists before the commit
            ids[project_id, name] = added.id
    return sessions, box, own, other, ids


def test_get_reads_a_secret_of_its_own_project_only(stored):
    sessions, _, own, other, ids = stored
    with sessions() as s:
        assert secrets.get(s, own, ids[own, "a"]).name == "a"
        assert secrets.get(s, other, ids[other, "a"]).id == ids[other, "a"]
        assert secrets.get(s, own, ids[other, "a"]) is None
        assert secrets.get(s, other, ids[own, "b"]) is None
        assert secrets.get(s, own, "secret-none") is None


def test_get_by_name_reads_the_projects_own_secret_of_that_name(stored):
    sessions, _, own, other, ids = stored
    with sessions() as s:
        assert secrets.get_by_name(s, own, "a").id == ids[own, "a"]
        assert secrets.get_by_name(s, other, "a").id == ids[other, "a"]
        assert secrets.get_by_name(s, other, "b") is None
        assert secrets.get_by_name(s, own, "c") is None


def test_hosts_name_each_of_the_projects_secrets_asked_for(stored):
    sessions, _, own, other, _ = stored
    with sessions() as s:
        assert secrets.hosts(s, own, iter(["a", "b", "missing"])) == {
            "a": ["a.example.com"], "b": ["b.example.com", "*.b.example.com"]}
        assert secrets.hosts(s, own, ["b"]) == {"b": ["b.example.com", "*.b.example.com"]}
        assert secrets.hosts(s, other, {"a", "b"}) == {"a": ["elsewhere.example.com"]}
        assert secrets.hosts(s, own, []) == {}


def test_values_are_decrypted_and_bound_to_their_own_hosts(stored):
    sessions, box, own, other, _ = stored
    with sessions() as s:
        got = secrets.values(s, own, iter(["a", "b", "missing"]), box)
        theirs = secrets.values(s, other, ["a", "b"], box)
        assert secrets.values(s, own, [], box) == {}
        assert secrets.values(s, own, ["b"], box) == {"b": "own-b"}
    assert got == {"a": "own-a", "b": "own-b"} and theirs == {"a": "other-a"}
    assert all(isinstance(v, BoundSecret) for v in (*got.values(), *theirs.values()))
    assert got["a"].hosts == ("a.example.com",) and got["b"].hosts == ("b.example.com", "*.b.example.com")
    assert theirs["a"].hosts == ("elsewhere.example.com",)


def test_pages_hold_the_projects_own_secrets_newest_first(stored):
    sessions, _, own, other, ids = stored
    with sessions() as s:
        first = secrets.page(s, own, after=None, limit=1)
        rest = secrets.page(s, own, after=first.items[0].id, limit=5)
        assert [x.id for x in first.items] == [ids[own, "b"]] and first.has_more
        assert [x.id for x in rest.items] == [ids[own, "a"]] and not rest.has_more
        assert [x.id for x in secrets.page(s, other, after=None, limit=5).items] == [ids[other, "a"]]


def test_delete_removes_that_secret_only(stored):
    sessions, box, own, other, ids = stored
    with sessions.begin() as s:
        secrets.delete(s, secrets.get(s, own, ids[own, "a"]))
    with sessions() as s:
        assert secrets.get(s, own, ids[own, "a"]) is None and secrets.get_by_name(s, own, "b") is not None
        assert secrets.values(s, other, ["a"], box) == {"a": "other-a"}
