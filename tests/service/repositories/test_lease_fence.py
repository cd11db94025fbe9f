"""The lease-epoch fence on every worker write, tried while the job is still running.

A worker that lost its lease (its lease ran out and another worker claimed the
job) must have each write refused by the epoch alone: the job's status is
`running` throughout, so a fence that forgot the epoch would let the write
through. record_step, heartbeat and finish are also covered through a worker
in tests/worker/jobs/test_job_runner.py.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from service.db.models import Checkpoint, File, Job, JobSample
from service.db.session import session_factory
from service.repositories import job_lease, job_outputs, job_records, jobs
from tests.service.repositories.job_rows import claimed, new_job

FILES = {"adapter.tar": {"sha256": "0" * 64, "bytes": 1}}


@pytest.fixture
def taken_over(database_url):
    """(sessions, job id, stale epoch, current epoch): w1's lease ran out and w2 holds the job now."""
    sessions = session_factory(database_url)
    _, job_id = new_job(sessions)
    stale = claimed(sessions, job_id, "w1", ttl_s=-1)  # expires at once
    current = claimed(sessions, job_id, "w2")
    assert current == stale + 1
    return sessions, job_id, stale, current


def _job(sessions, job_id) -> Job:
    with sessions() as s:
        return jobs.get_for_worker(s, job_id)


def _count(sessions, model, job_id) -> int:
    with sessions() as s:
        return s.scalar(select(func.count()).select_from(model).where(model.job_id == job_id))


def test_a_stale_epoch_cannot_add_a_checkpoint(taken_over):
    sessions, job_id, stale, current = taken_over
    with sessions.begin() as s:
        assert job_records.add_checkpoint(s, job_id, stale, step=1, storage_prefix="stale/1", files=FILES,
                                          metrics={}, ttl_s=600) is None
    assert _count(sessions, Checkpoint, job_id) == 0
    with sessions.begin() as s:
        assert job_records.add_checkpoint(s, job_id, current, step=1, storage_prefix="ok/1", files=FILES,
                                          metrics={}) is not None
    assert _count(sessions, Checkpoint, job_id) == 1


def test_a_stale_epoch_cannot_prune_checkpoints(taken_over):
    sessions, job_id, stale, current = taken_over
    with sessions.begin() as s:
        for step in (1, 2, 3):
            job_records.add_checkpoint(s, job_id, current, step=step, storage_prefix=f"ok/{step}", files=FILES,
                                       metrics={})
    with sessions.begin() as s:
        assert job_records.prune_checkpoints(s, job_id, stale, keep=1) == []
    assert _count(sessions, Checkpoint, job_id) == 3
    with sessions.begin() as s:
        assert sorted(job_records.prune_checkpoints(s, job_id, current, keep=1)) == ["ok/1", "ok/2"]
    assert _count(sessions, Checkpoint, job_id) == 1


def test_a_stale_epoch_cannot_requeue_the_job(taken_over):
    sessions, job_id, stale, current = taken_over
    for failed in (True, False):
        with sessions.begin() as s:
            assert not job_lease.requeue(s, job_id, stale, delay_s=5, failed=failed)
        job = _job(sessions, job_id)
        assert (job.status, job.lease_owner, job.lease_epoch, job.attempts) == ("running", "w2", current, 2)
        assert job.not_before is None
    with sessions.begin() as s:
        assert job_lease.requeue(s, job_id, current, failed=False)
    assert (_job(sessions, job_id).status, _job(sessions, job_id).attempts) == ("queued", 1)


def test_a_stale_epoch_cannot_write_samples_estimates_or_the_result_file(taken_over):
    sessions, job_id, stale, current = taken_over
    sample = {"prompt": "p", "completion": "c", "reward": 1.0, "advantage": 0.5, "rewards": {}}
    with sessions.begin() as s:
        assert not job_outputs.add_samples(s, job_id, stale, 1, [sample])
        assert not job_outputs.set_estimated_finish(s, job_id, stale, 12345)
        project_id = jobs.get_for_worker(s, job_id).project_id
        assert not job_outputs.attach_result_file(s, job_id, stale, File(
            project_id=project_id, filename="stale.csv", purpose="fine-tune-results", bytes=1, sha256="0" * 64, rows=0,
            storage_key="stale"))
    job = _job(sessions, job_id)
    assert (job.estimated_finish, job.result_file_id) == (None, None)
    assert _count(sessions, JobSample, job_id) == 0
    with sessions.begin() as s:
        assert job_outputs.add_samples(s, job_id, current, 1, [sample])
        assert job_outputs.set_estimated_finish(s, job_id, current, 12345)
    assert _count(sessions, JobSample, job_id) == 1 and _job(sessions, job_id).estimated_finish == 12345


def test_a_stale_epoch_cannot_record_a_step_renew_the_lease_or_finish(taken_over):
    sessions, job_id, stale, current = taken_over
    before = _job(sessions, job_id)
    with sessions.begin() as s:
        assert not job_records.record_step(s, job_id, stale, 4, {"loss": 1.0}, trained_tokens=5, ttl_s=600)
        assert job_lease.heartbeat(s, job_id, stale, ttl_s=600) is None
        assert not job_lease.finish(s, job_id, stale, "failed", error_code="x", error_message="stale")
    job = _job(sessions, job_id)
    assert (job.status, job.steps_done, job.trained_tokens, job.lease_expires_at, job.error_code) == (
        "running", 0, 0, before.lease_expires_at, None)
    with sessions() as s:
        assert jobs.metrics(s, job_id, names=None, step_min=None, step_max=None, limit=10) == []


def test_the_fence_holds_one_job_only(database_url):
    """Two jobs each at epoch 1: one's worker writing must not touch the other, which has the same epoch."""
    sessions = session_factory(database_url)
    ids = [new_job(sessions)[1] for _ in range(2)]
    mine, other = ((job_id, claimed(sessions, job_id)) for job_id in ids)
    assert mine[1] == other[1] == 1
    with sessions.begin() as s:
        assert job_lease.finish(s, mine[0], mine[1], "succeeded")
    assert (_job(sessions, other[0]).status, _job(sessions, mine[0]).status) == ("running", "succeeded")


def test_a_job_that_stopped_running_refuses_its_last_workers_writes(taken_over):
    """Paused (or ended) with the epoch unchanged: a write the worker still had in flight must not land."""
    sessions, job_id, _, current = taken_over
    with sessions.begin() as s:
        assert job_lease.finish(s, job_id, current, "paused")
    with sessions.begin() as s:
        assert not job_records.record_step(s, job_id, current, 1, {"loss": 1.0}, trained_tokens=3, ttl_s=60)
        assert job_lease.heartbeat(s, job_id, current, ttl_s=60) is None
        assert job_records.add_checkpoint(s, job_id, current, step=1, storage_prefix="late/1", files=FILES,
                                          metrics={}) is None
    job = _job(sessions, job_id)
    assert (job.status, job.steps_done, job.lease_expires_at) == ("paused", 0, None)
    assert _count(sessions, Checkpoint, job_id) == 0
