"""Registered reward functions and environments through their repositories (service/repositories/
reward_functions.py, environments.py), each read within its project; an environment is in use while a live job
of its project runs it; and the readiness probe's database ping (health.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from service.db.models import Environment, Job, RewardFunction
from service.db.session import session_factory
from service.repositories import environments, health, jobs, reward_functions


@pytest.mark.parametrize("repo, model, prefix", [(reward_functions, RewardFunction, "rwfn-"),
                                                 (environments, Environment, "env-")])
def test_registered_items_are_read_paged_and_deleted_within_their_project(two_projects, repo, model, prefix):
    sessions, own, other = two_projects
    with sessions.begin() as s:
        made = []
        for project_id, name in [(own, "first"), (own, "second"), (other, "theirs")]:
            added = repo.add(s, model(project_id=project_id, name=name, spec={"type": "x"}))
            assert added.id.startswith(prefix)  # flushed: the id exists before the commit
            made.append(added.id)
    first, second, theirs = made
    with sessions() as s:
        assert repo.get(s, own, first).name == "first" and repo.get(s, other, theirs).name == "theirs"
        assert repo.get(s, own, theirs) is None and repo.get(s, other, second) is None
        page = repo.page(s, own, after=None, limit=1)
        assert [x.id for x in page.items] == [second] and page.has_more
        assert [x.id for x in repo.page(s, own, after=second, limit=5).items] == [first]
        assert [x.id for x in repo.page(s, other, after=None, limit=5).items] == [theirs]
    with sessions.begin() as s:
        repo.delete(s, repo.get(s, own, first))
    with sessions() as s:
        assert repo.get(s, own, first) is None and repo.get(s, own, second) is not None
        assert repo.get(s, other, theirs) is not None


@pytest.mark.parametrize("status, live", [("validating_files", True), ("queued", True), ("running", True),
                                          ("paused", True), ("succeeded", False), ("failed", False),
                                          ("cancelled", False)])
def test_an_environment_is_in_use_while_a_live_job_of_its_project_runs_it(two_projects, status, live):
    sessions, own, other = two_projects

    def job(project_id: str, status: str, environment_id: str) -> str:
        return jobs.add(s, Job(project_id=project_id, status=status, model="m", training_file="file-t", spec={},
                               method={"type": "cispo"}, seed=1, total_steps=1, environment_id=environment_id)).id

    with sessions.begin() as s:
        using = job(own, status, "env-1")
        job(own, "queued", "env-2")
        job(other, "queued", "env-3")
    with sessions() as s:
        assert environments.live_job_using(s, own, "env-1") == (using if live else None)
        assert environments.live_job_using(s, own, "env-2") is not None
        assert environments.live_job_using(s, own, "env-3") is None  # the other project's job
        assert environments.live_job_using(s, own, "env-x") is None


def test_the_ping_answers_on_a_live_database_and_raises_on_a_dead_one(database_url, tmp_path):
    with session_factory(database_url)() as s:
        assert health.ping(s) is None
    (tmp_path / "not-a-dir").write_text("")
    dead = create_engine(f"sqlite:///{tmp_path / 'not-a-dir' / 'db.sqlite'}")
    with Session(dead) as s, pytest.raises(OperationalError):
        health.ping(s)
    dead.dispose()
