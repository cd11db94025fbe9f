"""Uploaded files through the repository (service/repositories/files.py): reads by id, by purpose and the row
counts a job's validation needs, each within one project. Paging itself is tested in test_pagination.py."""

from __future__ import annotations

import pytest

from service.db.models import File
from service.db.session import session_factory
from service.repositories import files, projects


@pytest.fixture
def stored(database_url):
    """(sessions, own project id, other project id, {label: file id})."""
    sessions = session_factory(database_url)
    ids = {}
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
        for label, project_id, purpose, rows in [("train", own, "fine-tune", 5),
                                                 ("results", own, "fine-tune-results", 7),
                                                 ("evals", own, "evals", 9), ("theirs", other, "fine-tune", 11)]:
            added = files.add(s, File(project_id=project_id, filename=f"{label}.jsonl", purpose=purpose, bytes=1,
                                      sha256="0" * 64, rows=rows, storage_key=label))
            assert added.id.startswith("file-")  # flushed: the id exists before the commit
            ids[label] = added.id
    return sessions, own, other, ids


def test_get_reads_a_file_of_its_own_project_only(stored):
    sessions, own, other, ids = stored
    with sessions() as s:
        assert files.get(s, own, ids["train"]).filename == "train.jsonl"
        assert files.get(s, other, ids["theirs"]).rows == 11
        assert files.get(s, own, ids["theirs"]) is None and files.get(s, other, ids["train"]) is None


def test_a_page_of_one_purpose_holds_only_that_purpose(stored):
    sessions, own, other, ids = stored

    def listed(project_id, purpose, ascending=False):
        page = files.page(s, project_id, after=None, limit=10, purpose=purpose, ascending=ascending)
        return [f.id for f in page.items]

    with sessions() as s:
        assert listed(own, "fine-tune-results") == [ids["results"]]
        assert listed(own, "fine-tune") == [ids["train"]]
        assert listed(own, None) == [ids["evals"], ids["results"], ids["train"]]
        assert listed(own, None, ascending=True) == [ids["train"], ids["results"], ids["evals"]]
        assert listed(other, "fine-tune") == [ids["theirs"]] and listed(other, "evals") == []


def test_rows_by_id_counts_the_projects_existing_files_only(stored):
    sessions, own, other, ids = stored
    with sessions() as s:
        assert files.rows_by_id(s, own, [ids["train"], ids["evals"], ids["train"], ids["theirs"], "file-gone"]) == {
            ids["train"]: 5, ids["evals"]: 9}
        assert files.rows_by_id(s, other, [ids["theirs"], ids["train"]]) == {ids["theirs"]: 11}
        assert files.rows_by_id(s, own, []) == {}


def test_delete_removes_that_file_only(stored):
    sessions, own, other, ids = stored
    with sessions.begin() as s:
        files.delete(s, files.get(s, own, ids["train"]))
    with sessions() as s:
        assert files.get(s, own, ids["train"]) is None
        assert files.rows_by_id(s, own, list(ids.values())) == {ids["results"]: 7, ids["evals"]: 9}
        assert files.get(s, other, ids["theirs"]) is not None


def test_a_page_by_sha256_finds_the_projects_copies_of_those_bytes_only(stored):
    sessions, own, other, ids = stored
    with sessions.begin() as s:
        copy = files.add(s, File(project_id=own, filename="again.jsonl", purpose="fine-tune", bytes=1,
                                 sha256="a" * 64, rows=5, storage_key="again")).id
    with sessions() as s:
        def found(project_id, sha256, purpose="fine-tune"):
            page = files.page(s, project_id, after=None, limit=10, purpose=purpose, ascending=False, sha256=sha256)
            return [f.id for f in page.items]

        assert found(own, "a" * 64) == [copy]
        assert found(own, "0" * 64) == [ids["train"]] and found(other, "0" * 64) == [ids["theirs"]]
        assert found(other, "a" * 64) == [] and found(own, "b" * 64) == []
