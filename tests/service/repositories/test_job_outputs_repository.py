"""What a running job leaves for people to read, through service/repositories/job_outputs.py itself: samples paged
newest step first, the result files, the event stream's reads. (The routes are tested in
tests/service/api/test_job_outputs.py, against a trained job: too slow to judge every small change here.)"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from service.db.models import File
from service.db.session import session_factory
from service.repositories import job_lease, job_outputs, jobs
from tests.service.repositories.job_rows import claimed, new_job, queued_job


@pytest.fixture
def running(database_url):
    """(sessions, job id, epoch, project id) of a job a worker holds."""
    sessions = session_factory(database_url)
    project_id, job_id = new_job(sessions)
    return sessions, job_id, claimed(sessions, job_id), project_id


def _sample(text: str) -> dict:
    return {"prompt": "p", "completion": text, "reward": 1.0, "advantage": 0.0, "rewards": {}}


def _ids(page) -> list[str]:
    return [job_outputs.sample_id(row) for row in page.items]


def test_samples_page_newest_step_first_in_slot_order(running):
    sessions, job_id, epoch, _ = running
    with sessions.begin() as s:
        for step in (1, 2):
            assert job_outputs.add_samples(s, job_id, epoch, step, [_sample(f"{step}.{i}") for i in range(3)])
    everything = ["ftsample-2-0", "ftsample-2-1", "ftsample-2-2", "ftsample-1-0", "ftsample-1-1", "ftsample-1-2"]
    with sessions() as s:
        first = job_outputs.samples(s, job_id, step=None, after=None, limit=4)
        assert (_ids(first), first.has_more) == (everything[:4], True)
        rest = job_outputs.samples(s, job_id, step=None, after=everything[3], limit=4)
        assert (_ids(rest), rest.has_more) == (everything[4:], False)
        exact = job_outputs.samples(s, job_id, step=None, after=None, limit=6)
        assert (_ids(exact), exact.has_more) == (everything, False)  # a full last page has nothing more
        one_step = job_outputs.samples(s, job_id, step=1, after=None, limit=10)
        assert (_ids(one_step), one_step.has_more) == (everything[3:], False)
        assert [r.completion for r in one_step.items] == ["1.0", "1.1", "1.2"]
        within = job_outputs.samples(s, job_id, step=2, after="ftsample-2-0", limit=10)
        assert _ids(within) == everything[1:3]


def test_samples_of_a_step_written_again_replace_the_earlier_ones(running):
    sessions, job_id, epoch, _ = running
    with sessions.begin() as s:
        job_outputs.add_samples(s, job_id, epoch, 1, [_sample("old a"), _sample("old b")])
        job_outputs.add_samples(s, job_id, epoch, 2, [_sample("other step")])
    with sessions.begin() as s:
        job_outputs.add_samples(s, job_id, epoch, 1, [_sample("new")])
    with sessions() as s:
        rows = job_outputs.samples(s, job_id, step=None, after=None, limit=10).items
        assert [(r.step, r.slot, r.completion) for r in rows] == [(2, 0, "other step"), (1, 0, "new")]


def test_writing_a_steps_samples_leaves_other_jobs_samples_of_that_step(running):
    sessions, job_id, epoch, project_id = running
    with sessions.begin() as s:
        other = queued_job(s, project_id)
    with sessions.begin() as s:
        other_epoch = job_lease.claim(s, other, "w2", ttl_s=60)
        assert job_outputs.add_samples(s, other, other_epoch, 1, [_sample("theirs")])
    with sessions.begin() as s:
        assert job_outputs.add_samples(s, job_id, epoch, 1, [_sample("mine")])
    with sessions() as s:
        assert [r.completion for r in job_outputs.samples(s, other, step=1, after=None, limit=10).items] == [
            "theirs"]


@pytest.mark.parametrize("bad", ["ftsample-1", "ftsample-1-2-3", "sample-1-2", "ftsample-x-2", "ftsample-1-"])
def test_a_malformed_sample_id_is_refused(bad):
    with pytest.raises(ValueError):
        job_outputs.parse_sample_id(bad)


def test_sample_ids_parse_back():
    assert job_outputs.parse_sample_id("ftsample-12-3") == (12, 3)


def test_result_files_are_attached_to_the_column_named(running):
    sessions, job_id, epoch, project_id = running

    def file(name: str) -> File:
        return File(project_id=project_id, filename=name, purpose="fine-tune-results", bytes=1, sha256="0" * 64,
                    rows=0, storage_key=name)

    with sessions.begin() as s:
        assert job_outputs.attach_result_file(s, job_id, epoch, file("metrics.csv"))
        assert job_outputs.attach_result_file(s, job_id, epoch, file("events.tfevents"),
                                              column="tensorboard_file_id")
    with sessions() as s:
        job = jobs.get_for_worker(s, job_id)
        names = {column: s.scalar(select(File.filename).where(File.id == getattr(job, column)))
                 for column in ("result_file_id", "tensorboard_file_id")}
    assert names == {"result_file_id": "metrics.csv", "tensorboard_file_id": "events.tfevents"}


def test_the_event_stream_reads_one_jobs_events_in_order(running):
    sessions, job_id, epoch, project_id = running
    with sessions.begin() as s:
        other = queued_job(s, project_id)
        first = jobs.add_event(s, job_id, "Job started").id
        jobs.add_event(s, job_id, "Step 1/10", type="metrics", data={"step": 1})
        jobs.add_event(s, job_id, "Checkpoint saved")
        foreign = jobs.add_event(s, other, "someone else's").id
    with sessions() as s:
        seq = job_outputs.event_seq(s, job_id, first)
        assert seq is not None and job_outputs.event_seq(s, job_id, foreign) is None
        status, rows = job_outputs.events_since(s, job_id, seq, include_metrics=True, limit=10)
        assert (status, [e.message for e in rows]) == ("running", ["Step 1/10", "Checkpoint saved"])
        _, rows = job_outputs.events_since(s, job_id, seq, include_metrics=False, limit=10)
        assert [e.message for e in rows] == ["Checkpoint saved"]
        _, rows = job_outputs.events_since(s, job_id, 0, include_metrics=True, limit=2)
        assert [e.message for e in rows] == ["Job started", "Step 1/10"]
        assert job_outputs.events_since(s, other, 0, include_metrics=True, limit=10)[1][0].message == \
            "someone else's"


def test_the_estimated_finish_is_the_last_one_written(running):
    sessions, job_id, epoch, _ = running
    with sessions.begin() as s:
        assert job_outputs.set_estimated_finish(s, job_id, epoch, 100)
        assert job_outputs.set_estimated_finish(s, job_id, epoch, 200)
    with sessions() as s:
        assert jobs.get_for_worker(s, job_id).estimated_finish == 200
