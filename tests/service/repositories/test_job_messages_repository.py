"""A queued job owed a broker message, through the repository (service/repositories/job_messages.py): the first
failure's time is kept, only queued jobs are owed one, and a sent message clears that job's mark alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.db.models import Job
from service.db.session import session_factory
from service.repositories import job_messages, jobs, projects


@pytest.fixture
def made(database_url, monkeypatch):
    """(sessions, clock, {label: job id}); the repository's time.time() reads clock[0]."""
    clock = [500.0]
    monkeypatch.setattr(job_messages, "time", SimpleNamespace(time=lambda: clock[0]))
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        project = projects.get_or_create_project(s, "own").id
        ids = {label: jobs.add(s, Job(project_id=project, status=status, model="m", training_file="file-t", spec={},
                                      method={"type": "cispo"}, seed=1, total_steps=1, not_before=not_before)).id
               for label, status, not_before in [("queued", "queued", None), ("later", "queued", 900.0),
                                                 ("running", "running", None), ("other", "queued", None)]}
    return sessions, clock, ids


def _failed_at(sessions, job_id: str) -> float | None:
    with sessions() as s:
        return jobs.get_for_worker(s, job_id).enqueue_failed_at


def test_a_failed_send_is_marked_once_on_a_queued_job_only(made):
    sessions, clock, ids = made
    with sessions.begin() as s:
        assert job_messages.mark_unsent(s, ids["queued"]) is True
        assert job_messages.mark_unsent(s, ids["running"]) is False
    clock[0] = 600.0
    with sessions.begin() as s:
        assert job_messages.mark_unsent(s, ids["queued"]) is False  # the first failure's time stays
        assert job_messages.mark_unsent(s, ids["later"]) is True
    assert [_failed_at(sessions, ids[k]) for k in ("queued", "later", "running", "other")] == [500.0, 600.0, None, None]


def test_unsent_lists_queued_jobs_owed_a_message_with_their_not_before(made):
    sessions, _, ids = made
    with sessions.begin() as s:
        for label in ("queued", "later"):
            job_messages.mark_unsent(s, ids[label])
        jobs.get_for_worker(s, ids["running"]).enqueue_failed_at = 400.0  # it failed while queued, then ran
    with sessions() as s:
        assert sorted(job_messages.unsent(s)) == sorted([(ids["queued"], None), (ids["later"], 900.0)])
    with sessions.begin() as s:
        job_messages.mark_sent(s, ids["queued"])
    with sessions() as s:
        assert job_messages.unsent(s) == [(ids["later"], 900.0)]
    assert _failed_at(sessions, ids["queued"]) is None and _failed_at(sessions, ids["running"]) == 400.0
