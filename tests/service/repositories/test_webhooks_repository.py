"""Webhook endpoints and the delivery outbox through the repository (service/repositories/webhooks.py): endpoints
are read within their project; a pass adds one delivery per ended job and subscribed endpoint registered by the
job's end, and takes a job off its work list once settled; a due delivery is claimed by one sender at a time and
its outcome recorded on it alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import select

from service.db.models import Job, WebhookDelivery, WebhookEndpoint
from service.db.session import session_factory
from service.repositories import jobs, projects
from service.repositories import webhooks as repo
from service.webhooks import EVENT_TYPES

T = 1_000_000  # the outbox's clock (now() and time.time()) in these tests
ALL = list(EVENT_TYPES.values())


@pytest.fixture
def outbox(database_url, monkeypatch):
    """(sessions, own project id, other project id), with the repository's clocks at T."""
    monkeypatch.setattr(repo, "now", lambda: T)
    monkeypatch.setattr(repo, "time", SimpleNamespace(time=lambda: float(T)))
    sessions = session_factory(database_url)
    with sessions.begin() as s:
        own, other = (projects.get_or_create_project(s, name).id for name in ("own", "other"))
    return sessions, own, other


def _endpoint(s, project_id: str, *, events=ALL, created_at: int = T - 1000) -> str:
    added = repo.add(s, WebhookEndpoint(project_id=project_id, url="https://hooks.example.com/x", secret="whsec_x",
                                        events=events, created_at=created_at))
    assert added.id.startswith("whep_")  # flushed: the id exists before the commit
    return added.id


def _ended(s, project_id: str, status: str, finished_at: int | None) -> str:
    return jobs.add(s, Job(project_id=project_id, status=status, model="m", training_file="file-t", spec={},
                           method={"type": "cispo"}, seed=1, total_steps=1, finished_at=finished_at)).id


def _deliveries(s) -> list[tuple[str, str, str]]:
    return sorted(s.execute(select(WebhookDelivery.endpoint_id, WebhookDelivery.job_id, WebhookDelivery.type)).all())


def _enqueued_at(s, job_id: str) -> int | None:
    return s.scalar(select(Job.webhooks_enqueued_at).where(Job.id == job_id))


def test_endpoints_are_read_paged_and_deleted_within_their_project(outbox):
    sessions, own, other = outbox
    with sessions.begin() as s:
        first, second, theirs = _endpoint(s, own), _endpoint(s, own), _endpoint(s, other)
    with sessions() as s:
        assert repo.get(s, own, first).id == first and repo.get(s, other, theirs).id == theirs
        assert repo.get(s, own, theirs) is None and repo.get(s, other, first) is None
        page = repo.page(s, own, after=None, limit=1)
        assert [e.id for e in page.items] == [second] and page.has_more
        assert [e.id for e in repo.page(s, own, after=second, limit=5).items] == [first]
        assert [e.id for e in repo.page(s, other, after=None, limit=5).items] == [theirs]
    with sessions.begin() as s:
        repo.delete(s, repo.get(s, own, first))
    with sessions() as s:
        assert repo.get(s, own, first) is None and repo.get(s, own, second) is not None
        assert repo.get(s, other, theirs) is not None


def test_a_pass_adds_a_delivery_per_ended_job_and_subscribed_endpoint(outbox):
    sessions, own, other = outbox
    with sessions.begin() as s:
        done = _ended(s, own, "succeeded", T - 500)
        failed = _ended(s, own, "failed", T - 400)
        cancelled = _ended(s, own, "cancelled", T - 300)
        _ended(s, own, "running", None)
        _ended(s, own, "queued", T - 200)  # requeued after it had ended: on no outcome's list
        theirs = _ended(s, other, "succeeded", T - 100)
        every = _endpoint(s, own, created_at=T - 1000)
        cancels = _endpoint(s, own, events=["fine_tuning.job.cancelled"], created_at=T - 1000)
        late = _endpoint(s, own, created_at=T - 400)  # registered as `failed` ended: it gets that one on
        their_endpoint = _endpoint(s, other, events=["fine_tuning.job.succeeded"], created_at=T - 1000)
    with sessions.begin() as s:
        assert repo.enqueue_outcomes(s, EVENT_TYPES) == 7
        assert repo.enqueue_outcomes(s, {}) == 0  # every ended job is on no list any more: settled
    with sessions() as s:
        assert _deliveries(s) == sorted([
            (every, done, "fine_tuning.job.succeeded"), (every, failed, "fine_tuning.job.failed"),
            (every, cancelled, "fine_tuning.job.cancelled"), (cancels, cancelled, "fine_tuning.job.cancelled"),
            (late, failed, "fine_tuning.job.failed"), (late, cancelled, "fine_tuning.job.cancelled"),
            (their_endpoint, theirs, "fine_tuning.job.succeeded")])
        row = s.scalars(select(WebhookDelivery).where(WebhookDelivery.job_id == done)).one()
        assert (row.id[:4], row.created_at, row.attempts, row.next_attempt_at) == ("evt_", T - 500, 0, T)
        assert row.delivered_at is None and row.failed_at is None


def test_a_job_of_a_project_without_endpoints_ends_on_no_delivery_and_leaves_the_list(outbox):
    sessions, own, other = outbox
    with sessions.begin() as s:
        unwatched = _ended(s, other, "failed", T - 300)  # `other` registered no endpoint
        watched = _ended(s, own, "failed", T - 200)
        endpoint = _endpoint(s, own)
    with sessions.begin() as s:
        assert repo.enqueue_outcomes(s, EVENT_TYPES) == 1
        assert [(e, j) for e, j, _ in _deliveries(s)] == [(endpoint, watched)]
        assert (_enqueued_at(s, unwatched), _enqueued_at(s, watched)) == (T, T)


def test_a_job_stays_on_the_work_list_until_settled_and_is_then_taken_off(outbox):
    sessions, own, _ = outbox
    with sessions.begin() as s:
        settled = _ended(s, own, "succeeded", T - repo.SETTLE_S)
        recent = _ended(s, own, "cancelled", T - repo.SETTLE_S + 1)
        endpoint = _endpoint(s, own)
    with sessions.begin() as s:
        assert repo.enqueue_outcomes(s, EVENT_TYPES) == 2
        assert (_enqueued_at(s, settled), _enqueued_at(s, recent)) == (T, None)
    with sessions.begin() as s:  # the next pass re-reads the recent one only; its repeat delivery is ignored
        assert repo.enqueue_outcomes(s, EVENT_TYPES) == 1
        assert [(e, j) for e, j, _ in _deliveries(s)] == sorted([(endpoint, settled), (endpoint, recent)])


def test_a_pass_takes_the_oldest_ended_jobs_first_limit_at_a_time(outbox):
    sessions, own, _ = outbox
    with sessions.begin() as s:
        newer = _ended(s, own, "succeeded", T - 200)
        older = _ended(s, own, "succeeded", T - 300)
        nobody = _ended(s, own, "failed", T - 250)
        _endpoint(s, own, events=["fine_tuning.job.succeeded"])
    with sessions.begin() as s:
        assert repo.enqueue_outcomes(s, EVENT_TYPES, limit=1) == 1
        assert [j for _, j, _ in _deliveries(s)] == [older] and _enqueued_at(s, newer) is None
    with sessions.begin() as s:
        assert repo.enqueue_outcomes(s, EVENT_TYPES, limit=1) == 0  # the failed one: no subscriber
        assert _enqueued_at(s, nobody) == T and _enqueued_at(s, newer) is None
        assert repo.enqueue_outcomes(s, EVENT_TYPES, limit=1) == 1
        assert _enqueued_at(s, newer) == T


def _delivery(s, endpoint_id: str, project_id: str, **columns) -> str:
    """A delivery of a job of its own (one delivery per endpoint and job)."""
    job_id = _ended(s, project_id, "succeeded", T - 100)
    s.add(row := WebhookDelivery(endpoint_id=endpoint_id, job_id=job_id, type="fine_tuning.job.succeeded",
                                 **{"next_attempt_at": T, **columns}))
    s.flush()
    return row.id


def test_due_lists_pending_deliveries_whose_time_came_soonest_first(outbox):
    sessions, own, _ = outbox
    with sessions.begin() as s:
        endpoint = _endpoint(s, own)
        later = _delivery(s, endpoint, own, next_attempt_at=T - 1)
        now_due = _delivery(s, endpoint, own, next_attempt_at=T)
        earliest = _delivery(s, endpoint, own, next_attempt_at=T - 5)
        _delivery(s, endpoint, own, next_attempt_at=T + 1)
        _delivery(s, endpoint, own, next_attempt_at=T - 9, delivered_at=T - 8)
        _delivery(s, endpoint, own, next_attempt_at=T - 9, failed_at=T - 8)
    with sessions() as s:
        assert repo.due(s, 10) == [earliest, later, now_due]
        assert repo.due(s, 2) == [earliest, later]



def test_an_endpoints_deliveries_are_paged_newest_first(outbox):
    sessions, own, _ = outbox
    with sessions.begin() as s:
        endpoint, elsewhere = _endpoint(s, own), _endpoint(s, own)
        made = [_delivery(s, endpoint, own) for _ in range(3)]
        _delivery(s, elsewhere, own)
    with sessions() as s:
        first = repo.deliveries(s, endpoint, after=None, limit=2)
        assert [d.id for d in first.items] == made[:0:-1] and first.has_more
        assert [d.id for d in repo.deliveries(s, endpoint, after=made[1], limit=2).items] == made[:1]


def test_a_claim_takes_a_due_delivery_for_one_attempt_only(outbox):
    sessions, own, _ = outbox
    with sessions.begin() as s:
        endpoint = _endpoint(s, own)
        due = _delivery(s, endpoint, own, attempts=2)
        other = _delivery(s, endpoint, own)
        early = _delivery(s, endpoint, own, next_attempt_at=T + 1)
        delivered = _delivery(s, endpoint, own, delivered_at=T - 1)
        failed = _delivery(s, endpoint, own, failed_at=T - 1)
    with sessions.begin() as s:
        delivery, got = repo.claim(s, due, 30.0)
        assert (delivery.id, delivery.attempts, delivery.next_attempt_at, got.id) == (due, 3, T + 30.0, endpoint)
    with sessions.begin() as s:
        assert repo.claim(s, due, 30.0) is None  # held by the first sender
        for taken in (early, delivered, failed, "evt_none"):
            assert repo.claim(s, taken, 30.0) is None, taken
    with sessions() as s:
        attempts = dict(s.execute(select(WebhookDelivery.id, WebhookDelivery.attempts)).all())
        assert attempts == {due: 3, other: 0, early: 0, delivered: 0, failed: 0}


def test_an_attempts_outcome_is_recorded_on_that_delivery_only(outbox):
    sessions, own, _ = outbox
    with sessions.begin() as s:
        endpoint = _endpoint(s, own)
        ok, retried, given_up, untouched = (_delivery(s, endpoint, own, last_error="before") for _ in range(4))
    with sessions.begin() as s:
        repo.record(s, ok, delivered=True, error=None, retry_at=None)
        repo.record(s, retried, delivered=False, error="HTTP 500", retry_at=T + 40.0)
        repo.record(s, given_up, delivered=False, error="HTTP 502", retry_at=None)
    with sessions() as s:
        rows = {d.id: (d.delivered_at, d.failed_at, d.next_attempt_at, d.last_error)
                for d in s.scalars(select(WebhookDelivery))}
    assert rows == {ok: (T, None, T, None), retried: (None, None, T + 40.0, "HTTP 500"),
                    given_up: (None, T, T, "HTTP 502"), untouched: (None, None, T, "before")}
