"""The API side's reads of jobs (service/repositories/jobs.py) through the repository itself: each one sees only
its project's or its job's rows, and filters and pages as the routes promise. The routes' own isolation is
tested in tests/service/api/test_isolation.py."""

from __future__ import annotations

import pytest

from service.repositories import job_lease, job_records, jobs
from tests.service.repositories.job_rows import queued_job


def _job(s, project_id: str, status: str = "queued", **columns) -> str:
    return queued_job(s, project_id, status=status, **{"training_file": "file-t", **columns})


def test_lookups_by_id_and_idempotency_key_stay_in_the_project(two_projects):
    sessions, own, other = two_projects
    with sessions.begin() as s:
        mine = _job(s, own, idempotency_key="k")
        theirs = _job(s, other, idempotency_key="k")
    with sessions() as s:
        assert jobs.get(s, own, mine).id == mine and jobs.get(s, own, theirs) is None
        assert jobs.find_by_idempotency_key(s, own, "k").id == mine
        assert jobs.find_by_idempotency_key(s, other, "k").id == theirs
        assert jobs.find_by_idempotency_key(s, own, "other key") is None


def test_the_quota_counts_the_projects_active_jobs_only(two_projects):
    sessions, own, other = two_projects
    with sessions.begin() as s:
        for status in ("validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"):
            _job(s, own, status)
        _job(s, other, "queued")
    with sessions() as s:
        assert jobs.active_count(s, own) == 3  # paused does not count


@pytest.mark.parametrize("status, live", [("validating_files", True), ("queued", True), ("running", True),
                                          ("paused", True), ("succeeded", False), ("failed", False),
                                          ("cancelled", False)])
def test_a_file_or_reward_function_is_in_use_while_a_live_job_of_the_project_names_it(two_projects, status, live):
    sessions, own, other = two_projects
    with sessions.begin() as s:
        job = _job(s, own, status, validation_file="file-v", reward_function_id="rwfn-1")
        _job(s, other, "queued", validation_file="file-o", reward_function_id="rwfn-o")
    expected = job if live else None
    with sessions() as s:
        assert jobs.live_job_uses(s, own, file_id="file-t") == expected
        assert jobs.live_job_uses(s, own, file_id="file-v") == expected
        assert jobs.live_job_uses(s, own, reward_function_id="rwfn-1") == expected
        assert jobs.live_job_uses(s, own, file_id="file-x") is None
        assert jobs.live_job_uses(s, own, reward_function_id="rwfn-x") is None
        assert jobs.live_job_uses(s, own, file_id="file-o") is None  # the other project's job
        assert jobs.live_job_uses(s, own, reward_function_id="rwfn-o") is None


def test_metrics_filter_by_name_and_step_range_in_step_then_name_order(two_projects):
    sessions, own, _ = two_projects
    with sessions.begin() as s:
        job_id = _job(s, own)
        other = _job(s, own)
    with sessions.begin() as s:
        epoch = job_lease.claim(s, job_id, "w", ttl_s=60)
        for step in (1, 2, 3, 4):
            job_records.record_step(s, job_id, epoch, step, {"loss": step / 10, "kl": step / 100}, trained_tokens=0,
                                    ttl_s=60)
        job_records.record_step(s, other, job_lease.claim(s, other, "w", ttl_s=60), 1, {"loss": 9.0}, trained_tokens=0,
                                     ttl_s=60)

    def read(**kw):
        kw = {"names": None, "step_min": None, "step_max": None, "limit": 100, **kw}
        with sessions() as s:
            return [(m.step, m.name) for m in jobs.metrics(s, job_id, **kw)]

    assert read() == [(step, name) for step in (1, 2, 3, 4) for name in ("kl", "loss")]
    assert read(names=["loss"]) == [(1, "loss"), (2, "loss"), (3, "loss"), (4, "loss")]
    assert read(step_min=2, step_max=3) == [(2, "kl"), (2, "loss"), (3, "kl"), (3, "loss")]
    assert read(limit=3) == [(1, "kl"), (1, "loss"), (2, "kl")]


def test_checkpoints_are_read_through_their_job_and_project(two_projects):
    sessions, own, other = two_projects
    with sessions.begin() as s:
        mine, theirs = _job(s, own), _job(s, other)
    with sessions.begin() as s:
        ids = {}
        for job_id in (mine, theirs):
            epoch = job_lease.claim(s, job_id, "w", ttl_s=60)
            for step in (2, 1):
                ids[job_id, step] = job_records.add_checkpoint(s, job_id, epoch, step=step,
                                                               storage_prefix=f"{job_id}/{step}", files={},
                                                               metrics={}).id
    with sessions() as s:
        assert jobs.checkpoint(s, mine, ids[mine, 1]).step == 1
        assert jobs.checkpoint(s, mine, ids[theirs, 1]) is None  # a foreign checkpoint under one's own job
        assert jobs.project_checkpoint(s, own, ids[mine, 2]).step == 2
        assert jobs.project_checkpoint(s, own, ids[theirs, 2]) is None
        assert jobs.latest_checkpoint(s, mine).id == ids[mine, 2]  # the highest step, not the newest row
        listed = jobs.checkpoints(s, mine, after=None, limit=10)
        assert [c.id for c in listed.items] == [ids[mine, 1], ids[mine, 2]] and not listed.has_more


def test_a_metadata_filter_reads_past_the_first_chunk_and_pages(two_projects):
    sessions, own, other = two_projects
    with sessions.begin() as s:
        # Newest first: 48 untagged, two tagged (the second last in the first chunk of 50), 10 untagged, one tagged.
        tagged = [_job(s, own, metadata_={"run": "a"})]
        for _ in range(10):
            _job(s, own, metadata_={"run": "b"})
        tagged += [_job(s, own, metadata_={"run": "a"}), _job(s, own, metadata_={"run": "a"})]
        for _ in range(48):
            _job(s, own, metadata_={"run": "b"})
        _job(s, other, metadata_={"run": "a"})
    newest = tagged[::-1]
    with sessions() as s:
        first = jobs.page(s, own, after=None, limit=2, metadata={"run": "a"})
        assert ([j.id for j in first.items], first.has_more) == (newest[:2], True)
        rest = jobs.page(s, own, after=first.items[-1].id, limit=2, metadata={"run": "a"})
        assert ([j.id for j in rest.items], rest.has_more) == (newest[2:], False)
        everything = jobs.page(s, own, after=None, limit=10, metadata={"run": "a"})  # each chunk read once
        assert ([j.id for j in everything.items], everything.has_more) == (newest, False)
        assert jobs.page(s, own, after=None, limit=5, metadata={"run": "c"}).items == []
