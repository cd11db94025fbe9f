"""The job state machine's worker side, through the repositories themselves (service/repositories/job_lease.py,
job_records.py, job_recovery.py): which jobs a worker may claim, what a claim, heartbeat, finish or requeue
leaves on the row, and the reconciler's sweeps (expired leases, exhausted attempts, lost broker messages). The API side's transitions are tested through the routes in
tests/service/api/test_jobs_lifecycle.py; the lease-epoch fence in tests/service/repositories/test_lease_fence.py."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select, update

from service.db.models import Job, JobEvent
from service.db.session import session_factory
from service.repositories import job_lease, job_records, job_recovery, jobs
from tests.service.repositories.job_rows import new_job


@pytest.fixture
def sessions(database_url):
    return session_factory(database_url)


def _new_job(sessions, **columns) -> str:
    return new_job(sessions, **columns)[1]


def _set(sessions, job_id: str, **values) -> None:
    with sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))


def _job(sessions, job_id: str) -> Job:
    with sessions() as s:
        return jobs.get_for_worker(s, job_id)


def _claim(sessions, job_id: str, owner: str = "w", ttl_s: float = 60, **kw) -> int | None:
    with sessions.begin() as s:
        return job_lease.claim(s, job_id, owner, ttl_s, **kw)


def _events(sessions, job_id: str) -> list[tuple[str, str]]:
    with sessions() as s:
        return [(e.level, e.message) for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)
                                                        .order_by(JobEvent.seq))]


def test_a_claim_takes_the_lease_uses_an_attempt_and_clears_the_waits(sessions):
    job_id = _new_job(sessions, not_before=time.time() - 1, enqueue_failed_at=123.0)
    before = time.time()
    assert _claim(sessions, job_id, "w1", ttl_s=60) == 1
    job = _job(sessions, job_id)
    assert (job.status, job.lease_owner, job.lease_epoch, job.attempts) == ("running", "w1", 1, 1)
    assert (job.not_before, job.enqueue_failed_at) == (None, None)
    assert before + 60 <= job.lease_expires_at <= time.time() + 60
    started = job.started_at
    assert before - 1 <= started <= time.time()

    _set(sessions, job_id, lease_expires_at=time.time() - 1, started_at=started - 100)  # w1 died
    assert _claim(sessions, job_id, "w2") == 2
    job = _job(sessions, job_id)
    assert (job.lease_owner, job.attempts, job.started_at) == ("w2", 2, started - 100)  # first start kept


FUTURE = object()  # ten minutes from when the test runs (a time taken at collection can be long past by then)


@pytest.mark.parametrize("columns", [
    {"not_before": FUTURE},  # still backing off
    {"status": "running", "lease_expires_at": FUTURE},  # another worker's live lease
    {"attempts": 3},  # none left (max_attempts 3)
    {"status": "paused"}, {"status": "validating_files"}, {"status": "succeeded"}, {"status": "failed"},
    {"status": "cancelled"},
], ids=lambda c: "-".join(f"{k}" if k != "status" else v for k, v in c.items()))
def test_a_job_that_is_not_runnable_cannot_be_claimed(sessions, columns):
    job_id = _new_job(sessions, **{k: time.time() + 600 if v is FUTURE else v for k, v in columns.items()})
    before = _job(sessions, job_id)
    assert _claim(sessions, job_id) is None
    after = _job(sessions, job_id)
    assert (after.status, after.lease_owner, after.lease_epoch, after.attempts) == (
        before.status, before.lease_owner, before.lease_epoch, before.attempts)


def test_the_attempt_limit_is_the_callers(sessions):
    job_id = _new_job(sessions, attempts=4)
    assert _claim(sessions, job_id, max_attempts=4) is None
    assert _claim(sessions, job_id, max_attempts=5) == 1


def test_a_heartbeat_renews_the_lease_and_passes_on_what_the_api_asked(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id, ttl_s=1)
    with sessions.begin() as s:
        assert job_lease.heartbeat(s, job_id, epoch, ttl_s=300) == job_lease.Control(cancel=False, pause=False)
    assert _job(sessions, job_id).lease_expires_at >= time.time() + 290
    for cancel, pause in ((True, False), (False, True)):
        _set(sessions, job_id, cancel_requested=cancel, pause_requested=pause)
        with sessions.begin() as s:
            assert job_lease.heartbeat(s, job_id, epoch, ttl_s=60) == job_lease.Control(cancel=cancel, pause=pause)


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_finishing_ends_the_lease_and_stamps_the_end(sessions, status):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id)
    _set(sessions, job_id, cancel_requested=True, pause_requested=True)
    with sessions.begin() as s:
        assert job_lease.finish(s, job_id, epoch, status, error_code="boom", error_message="it broke",
                                error_param="training_file")
    job = _job(sessions, job_id)
    assert (job.status, job.lease_owner, job.lease_expires_at, job.attempts) == (status, None, None, 1)
    assert (job.cancel_requested, job.pause_requested) == (False, False)
    assert abs(job.finished_at - time.time()) <= 5
    assert (job.error_code, job.error_message, job.error_param) == ("boom", "it broke", "training_file")


def test_a_pause_gives_the_attempt_back_and_is_no_end(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id)
    with sessions.begin() as s:
        assert job_lease.finish(s, job_id, epoch, "paused")
    job = _job(sessions, job_id)
    assert (job.status, job.attempts, job.finished_at, job.error_code) == ("paused", 0, None, None)


def test_a_failed_run_waits_its_backoff_before_it_can_be_claimed_again(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id)
    with sessions.begin() as s:
        assert job_lease.requeue(s, job_id, epoch, delay_s=300)
    job = _job(sessions, job_id)
    assert (job.status, job.lease_owner, job.lease_expires_at, job.attempts) == ("queued", None, None, 1)
    assert time.time() + 290 <= job.not_before <= time.time() + 300
    assert _claim(sessions, job_id) is None
    _set(sessions, job_id, not_before=time.time() - 1)
    assert _claim(sessions, job_id) == 2


def test_a_requeue_without_a_delay_can_be_claimed_at_once_and_still_counts_the_attempt(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id)
    with sessions.begin() as s:
        assert job_lease.requeue(s, job_id, epoch)
    job = _job(sessions, job_id)
    assert (job.status, job.not_before, job.attempts) == ("queued", None, 1)
    epoch = _claim(sessions, job_id)
    assert (epoch, _job(sessions, job_id).attempts) == (2, 2)
    before = time.time()
    with sessions.begin() as s:
        assert job_lease.requeue(s, job_id, epoch, delay_s=0.5)  # even a short backoff is one
    assert before + 0.5 <= _job(sessions, job_id).not_before <= time.time() + 0.5



def test_running_epochs_are_those_of_the_running_jobs_asked_for(sessions):
    first, second = _new_job(sessions), _new_job(sessions)
    queued, paused, unasked = _new_job(sessions), _new_job(sessions), _new_job(sessions)
    assert _claim(sessions, first) == 1
    _claim(sessions, second, ttl_s=-1)  # its lease runs out and it is claimed again: the epoch is the newest
    assert _claim(sessions, second) == 2
    epoch = _claim(sessions, paused)
    with sessions.begin() as s:
        assert job_lease.finish(s, paused, epoch, "paused")
    _claim(sessions, unasked)
    with sessions() as s:
        assert job_lease.running_epochs(s, [first, second, queued, paused, "job-none"]) == {first: 1, second: 2}
        assert job_lease.running_epochs(s, []) == {}

def test_retry_and_outage_delays():
    assert [job_recovery.retry_delay(a, base_s=5) for a in (0, 1, 2, 3, 4)] == [5, 5, 10, 20, 40]
    assert job_recovery.retry_delay(20, base_s=5) == 360 and job_recovery.retry_delay(20, base_s=5, cap_s=7) == 7
    assert [job_recovery.outage_delay(e, base_s=2) for e in (0, 2, 3, 30)] == [2, 2, 3, 30]
    assert job_recovery.outage_delay(3600, base_s=2) == 60 and job_recovery.outage_delay(3600, base_s=2, cap_s=9) == 9


def test_an_outage_is_dated_from_its_first_report_until_a_checkpoint_commits(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id)
    before = time.time()
    with sessions.begin() as s:
        first = job_records.note_outage(s, job_id, epoch)
    assert before <= first <= time.time()
    with sessions.begin() as s:
        assert job_records.note_outage(s, job_id, epoch) == first
        assert job_records.note_outage(s, job_id, epoch + 1) is None
    with sessions.begin() as s:
        assert job_records.add_checkpoint(s, job_id, epoch, step=1, storage_prefix="c/1", files={}, metrics={})
    assert _job(sessions, job_id).outage_since is None


def test_a_checkpoint_step_recorded_twice_is_the_first_one(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id, ttl_s=1)
    with sessions.begin() as s:
        first = job_records.add_checkpoint(s, job_id, epoch, step=2, storage_prefix="c/2", files={}, metrics={"a": 1})
        again = job_records.add_checkpoint(s, job_id, epoch, step=2, storage_prefix="c/2b", files={}, metrics={},
                                           ttl_s=300)
        assert (again.id, again.storage_prefix) == (first.id, "c/2")
    assert _job(sessions, job_id).lease_expires_at >= time.time() + 290  # renewed by the write


def test_pruning_keeps_the_newest_and_the_spared_one(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id)
    with sessions.begin() as s:
        ids = {step: job_records.add_checkpoint(s, job_id, epoch, step=step, storage_prefix=f"c/{step}", files={},
                                                metrics={}).id for step in (1, 2, 3, 4)}
    with sessions.begin() as s:
        assert sorted(job_records.prune_checkpoints(s, job_id, epoch, keep=2, spare=ids[1])) == ["c/2"]
    with sessions() as s:
        assert {c.step for c in jobs.checkpoints(s, job_id, after=None, limit=10).items} == {1, 3, 4}
        assert jobs.latest_checkpoint(s, job_id).step == 4


def test_steps_done_never_goes_back(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id)
    with sessions.begin() as s:
        assert job_records.record_step(s, job_id, epoch, 5, {"loss": 1.0}, trained_tokens=0, ttl_s=60)
        assert job_records.record_step(s, job_id, epoch, 3, {"loss": 1.0}, trained_tokens=0, ttl_s=60)
    assert _job(sessions, job_id).steps_done == 5


def test_exhausted_jobs_fail_unless_a_live_lease_holds_them(sessions):
    queued = _new_job(sessions, attempts=3)
    expired = _new_job(sessions, status="running", attempts=3, lease_owner="w", lease_expires_at=time.time() - 1)
    live = _new_job(sessions, status="running", attempts=3, lease_owner="w", lease_expires_at=time.time() + 600)
    left = _new_job(sessions, attempts=2)
    with sessions.begin() as s:
        assert [job_recovery.fail_exhausted(s, j, max_attempts=3) for j in (queued, expired, live, left)] == [
            True, True, False, False]
    for job_id in (queued, expired):
        job = _job(sessions, job_id)
        assert (job.status, job.error_code, job.lease_owner, job.lease_expires_at) == (
            "failed", "too_many_attempts", None, None)
        assert job.error_message == ("the job failed 3 times: its worker crashed or lost its lease each time "
                                     "(see the job's events)")
        assert abs(job.finished_at - time.time()) <= 5
        assert _events(sessions, job_id) == [("error", "Job failed: no attempts left after 3")]
    for job_id, status in ((live, "running"), (left, "queued")):
        assert _job(sessions, job_id).status == status and _events(sessions, job_id) == []


def test_expired_leases_are_queued_again_after_a_backoff_or_failed_when_exhausted(sessions):
    # The exhausted job first: failing it must not end the pass before the others.
    exhausted = _new_job(sessions, status="running", attempts=3, lease_owner="w", lease_expires_at=time.time() - 1)
    expired = _new_job(sessions, status="running", attempts=2, lease_owner="w", lease_expires_at=time.time() - 1)
    live = _new_job(sessions, status="running", attempts=1, lease_owner="w", lease_expires_at=time.time() + 600)
    queued = _new_job(sessions, lease_expires_at=time.time() - 1)
    with sessions.begin() as s:
        assert job_recovery.requeue_expired(s, max_attempts=3, backoff_s=10) == [expired]
    job = _job(sessions, expired)
    assert (job.status, job.lease_owner, job.lease_expires_at, job.attempts) == ("queued", None, None, 2)
    assert time.time() + 15 <= job.not_before <= time.time() + 20  # retry_delay(2, base 10)
    assert _events(sessions, expired) == [
        ("warn", "The worker stopped responding; the job runs again in 20 s (attempt 3 of 3)")]
    assert _job(sessions, exhausted).status == "failed"
    assert (_job(sessions, live).status, _job(sessions, live).lease_owner) == ("running", "w")
    assert _job(sessions, queued).status == "queued" and _events(sessions, queued) == []


def test_queued_before_lists_old_queued_jobs_past_their_backoff(sessions):
    t = int(time.time())
    old = _new_job(sessions, created_at=t - 100)
    waited = _new_job(sessions, created_at=t - 100, not_before=time.time() - 1)
    backing_off = _new_job(sessions, created_at=t - 100, not_before=time.time() + 600)
    _new_job(sessions, created_at=t - 100, status="running")
    _new_job(sessions, created_at=t)  # too new
    with sessions() as s:
        assert sorted(job_recovery.queued_before(s, t - 50)) == sorted([old, waited])
        assert backing_off not in job_recovery.queued_before(s, t + 1)


def _api_job(sessions, status: str) -> str:
    job_id = _new_job(sessions)
    if status == "running":
        _claim(sessions, job_id)
    else:
        _set(sessions, job_id, status=status)
    return job_id


def _act(sessions, job_id: str, action) -> Job:
    with sessions.begin() as s:
        return action(s, jobs.get_for_worker(s, job_id))


@pytest.mark.parametrize("status", ["validating_files", "queued", "paused"])
def test_a_job_not_yet_running_is_cancelled_at_once(sessions, status):
    job_id = _api_job(sessions, status)
    _act(sessions, job_id, jobs.request_cancel)
    job = _job(sessions, job_id)
    assert (job.status, job.cancel_requested) == ("cancelled", False)
    assert abs(job.finished_at - time.time()) <= 5
    assert _events(sessions, job_id) == [("info", "Job cancelled")]


def test_a_running_job_is_asked_to_cancel_or_pause_and_keeps_its_lease(sessions):
    job_id = _api_job(sessions, "running")
    _act(sessions, job_id, jobs.request_cancel)
    _act(sessions, job_id, jobs.request_pause)
    job = _job(sessions, job_id)
    assert (job.status, job.lease_owner, job.cancel_requested, job.pause_requested, job.finished_at) == (
        "running", "w", True, True, None)
    assert _events(sessions, job_id) == [
        ("info", "Cancellation requested; the job stops at the end of its current step"),
        ("info", "Pause requested; the job checkpoints and pauses after its current step")]


def test_a_queued_job_pauses_at_once_and_resumes_to_the_queue(sessions):
    job_id = _api_job(sessions, "queued")
    _act(sessions, job_id, jobs.request_pause)
    assert _job(sessions, job_id).status == "paused"
    _set(sessions, job_id, pause_requested=True)  # as a running job's pause leaves it
    _act(sessions, job_id, jobs.resume)
    job = _job(sessions, job_id)
    assert (job.status, job.pause_requested) == ("queued", False)
    assert _events(sessions, job_id) == [("info", "Job paused"), ("info", "Job resumed")]


@pytest.mark.parametrize("action, word, refused_in", [
    (jobs.request_cancel, "cancelled", ["succeeded", "failed", "cancelled"]),
    (jobs.request_pause, "paused", ["validating_files", "paused", "succeeded", "failed", "cancelled"]),
    (jobs.resume, "resumed", ["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]),
])
def test_an_illegal_transition_says_what_was_refused_and_changes_nothing(sessions, action, word, refused_in):
    for status in refused_in:
        job_id = _api_job(sessions, status)
        with pytest.raises(jobs.IllegalTransition) as refused:
            _act(sessions, job_id, action)
        assert str(refused.value) == f"job {job_id} is {status}; it cannot be {word}"
        assert refused.value.action == word
        job = _job(sessions, job_id)
        assert (job.status, job.cancel_requested, job.pause_requested) == (status, False, False)
        assert _events(sessions, job_id) == []


def test_recording_a_step_or_a_checkpoint_renews_the_lease_only_when_asked(sessions):
    job_id = _new_job(sessions)
    epoch = _claim(sessions, job_id, ttl_s=1)
    with sessions.begin() as s:
        assert job_records.record_step(s, job_id, epoch, 1, {"loss": 1.0}, trained_tokens=0, ttl_s=300)
    renewed = _job(sessions, job_id).lease_expires_at
    assert renewed >= time.time() + 290
    with sessions.begin() as s:
        assert job_records.add_checkpoint(s, job_id, epoch, step=1, storage_prefix="c/1", files={}, metrics={})
    assert _job(sessions, job_id).lease_expires_at == renewed  # no ttl_s: the lease is left as it is
