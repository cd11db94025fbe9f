"""Operator reads across projects through the repository (service/repositories/fleet.py): job counts per status,
and each running job's progress with the latest value of each gauged metric."""

from __future__ import annotations

import pytest

from service.db.models import Job, JobMetric
from service.db.session import session_factory
from service.repositories import fleet, jobs, projects


@pytest.fixture
def sessions(database_url):
    return session_factory(database_url)


def _job(s, project_id: str, status: str, **columns) -> str:
    return jobs.add(s, Job(project_id=project_id, status=status, model="m", training_file="file-t", spec={},
                           method={"type": "cispo"}, seed=1, **{"total_steps": 10, **columns})).id


def _metrics(s, job_id: str, step: int, **values: float) -> None:
    s.add_all(JobMetric(job_id=job_id, step=step, name=name, value=value) for name, value in values.items())


def test_jobs_are_counted_per_status_across_projects(sessions):
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
        for project_id, status in [(own, "queued"), (own, "queued"), (other, "queued"), (own, "running"),
                                   (other, "failed")]:
            _job(s, project_id, status)
    with sessions() as s:
        assert fleet.jobs_by_status(s) == {"queued": 3, "running": 1, "failed": 1}


def test_running_jobs_show_their_progress_and_each_gauges_latest_value(sessions):
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
        first = _job(s, own, "running", steps_done=2, total_steps=8)
        queued = _job(s, own, "queued")
        second = _job(s, other, "running", steps_done=0, total_steps=3)
        idle = _job(s, own, "running", steps_done=1, total_steps=4)
        _metrics(s, first, 1, reward_mean=0.1, tokens_per_second=50.0, sampled_tokens_per_second=70.0, loss=1.0)
        _metrics(s, first, 2, reward_mean=0.4, loss=0.5)  # tokens/s not measured at step 2: step 1's stays
        _metrics(s, second, 3, reward_mean=0.9)
        _metrics(s, queued, 5, reward_mean=0.7)
        _metrics(s, idle, 1, loss=2.0)
    with sessions() as s:
        assert fleet.running_jobs(s) == [
            fleet.RunningJob(first, 2, 8, {"reward_mean": 0.4, "tokens_per_second": 50.0,
                                           "sampled_tokens_per_second": 70.0}),
            fleet.RunningJob(second, 0, 3, {"reward_mean": 0.9}),
            fleet.RunningJob(idle, 1, 4, {}),
        ]


def test_a_gauge_is_read_at_its_own_jobs_latest_step_not_another_jobs(sessions):
    with sessions.begin() as s:
        project = projects.get_or_create_project(s, "own").id
        # Ids on both sides of the job whose latest step (1) is an earlier step of the others'; each job's later
        # step written first, so a read that picked by the order of rows would end on the earlier step.
        first, second, third = (_job(s, project, "running", id=f"ftjob-{c}") for c in "abc")
        _metrics(s, first, 2, reward_mean=0.2)
        _metrics(s, third, 3, reward_mean=0.8)
        s.flush()
        _metrics(s, first, 1, reward_mean=0.1)
        _metrics(s, second, 1, reward_mean=0.5)
        _metrics(s, third, 1, reward_mean=0.7)
    with sessions() as s:
        assert {j.id: j.latest for j in fleet.running_jobs(s)} == {
            first: {"reward_mean": 0.2}, second: {"reward_mean": 0.5}, third: {"reward_mean": 0.8}}


def test_no_running_job_is_an_empty_list(sessions):
    with sessions.begin() as s:
        _job(s, projects.get_or_create_project(s, "own").id, "queued")
    with sessions() as s:
        assert fleet.running_jobs(s) == []
