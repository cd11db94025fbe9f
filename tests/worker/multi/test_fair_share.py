"""Fair share of a shared worker's slots between projects: the order (service/fair_share.py), and a worker with a free
slot taking the job that order puts first rather than the oldest."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from service.db.models import Job, JobEvent
from service.db.session import session_factory
from service.fair_share import Waiting, fair_order
from service.repositories import projects
from service.settings import Settings
from tests.worker.jobs.test_job_runner import job_row, make_settings, submit
from worker.multi.runner import run_shared


def _waiting(*projects_in_creation_order: str) -> list[Waiting]:
    """One waiting job per argument, created one second apart; ids name the project and its n-th job."""
    seen: dict[str, int] = {}
    out = []
    for t, project in enumerate(projects_in_creation_order):
        seen[project] = seen.get(project, 0) + 1
        out.append(Waiting(f"{project}{seen[project]}", project, created_at=100 + t, seq=t))
    return out


def test_projects_take_turns_by_default():
    order = fair_order(_waiting("a", "a", "a", "b", "b"), running={}, weights={})
    assert order == ["a1", "b1", "a2", "b2", "a3"]  # oldest first would be a1 a2 a3 b1 b2


def test_a_project_already_running_jobs_waits_behind_one_running_none():
    assert fair_order(_waiting("a", "b", "a"), running={"a": 2}, weights={}) == ["b1", "a1", "a2"]


def test_a_project_of_weight_two_gets_two_slots_to_one():
    # a's turns: 1/2, 2/2, 3/2, 4/2; b's: 1, 2; ties go to the older job.
    order = fair_order(_waiting("a", "a", "a", "a", "b", "b"), running={}, weights={"a": 2})
    assert order == ["a1", "a2", "b1", "a3", "a4", "b2"]
    # Exact ties: a weight of 3 against running jobs (float division would order 1/3 * 3 and 1 by rounding).
    assert fair_order(_waiting("b", "a"), running={"a": 2}, weights={"a": 3}) == ["b1", "a1"]


def test_weights_must_be_positive_numbers(monkeypatch):
    monkeypatch.setenv("CISPO_PROJECT_WEIGHTS", '{"research": 2.5}')
    assert Settings().project_weights == {"research": 2.5}
    for bad in ('{"research": 0}', '{"research": -1}', '{"research": "lots"}'):
        monkeypatch.setenv("CISPO_PROJECT_WEIGHTS", bad)
        with pytest.raises(ValidationError, match="project_weights"):
            Settings()


def _move_to_project(settings, job_id: str, name: str) -> None:
    with session_factory(settings.resolved_database_url()).begin() as s:
        project = projects.get_or_create_project(s, name)
        s.execute(update(Job).where(Job.id == job_id).values(project_id=project.id))


def _start_order(settings, job_ids: list[str]) -> list[str]:
    with session_factory(settings.resolved_database_url()).begin() as s:
        started = s.execute(select(JobEvent.job_id).where(JobEvent.job_id.in_(job_ids),
                                                          JobEvent.message.startswith("Job started"))
                            .order_by(JobEvent.seq)).scalars()
        return list(dict.fromkeys(started))


def test_a_free_slot_takes_the_other_projects_job_before_an_older_one_of_the_running_project(
        database_url, toy_dir, tmp_path):
    settings = make_settings(tmp_path, database_url).model_copy(update={"worker_jobs": 2})
    first = submit(settings, toy_dir, steps=2, checkpoint_interval=0)  # project "p"
    older_of_p = submit(settings, toy_dir, steps=1, checkpoint_interval=0)
    other_project = submit(settings, toy_dir, steps=1, checkpoint_interval=0)
    _move_to_project(settings, other_project, "q")
    assert run_shared(first, settings) == "succeeded"
    # p runs `first`, so q's job, though newer, takes the free slot; p's second job comes after.
    assert _start_order(settings, [first, older_of_p, other_project]) == [first, other_project, older_of_p]
    assert all(job_row(settings, j).status == "succeeded" for j in (first, older_of_p, other_project))
