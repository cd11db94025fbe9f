"""The poll cache and the principal cache: what pollers are served, how stale it may be, and for whom."""

from __future__ import annotations

import threading

import anyio
from anyio import from_thread

from service.api.poll_cache import PollCache
from service.repositories import job_lease, job_records, jobs as jobs_repo
from service.repositories import projects
from tests.service.api.conftest import assert_error, created_job

JOBS = "/v1/fine_tuning/jobs"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _frozen(api) -> Clock:
    clock = Clock()
    api.app.state.poll_cache.clock = clock
    api.app.state.principals.clock = clock
    return clock


def test_a_cached_job_or_events_page_is_never_served_to_another_project(api):
    _frozen(api)  # nothing expires during the test
    job = created_job(api)
    owner_view = api.client.get(f"{JOBS}/{job['id']}")
    assert owner_view.status_code == 200 and owner_view.json()["id"] == job["id"]
    assert api.client.get(f"{JOBS}/{job['id']}/events").status_code == 200

    # The same job id from another project: its own 404, not the owner's cached bytes.
    assert_error(api.other.get(f"{JOBS}/{job['id']}"), 404, job["id"])
    assert_error(api.other.get(f"{JOBS}/{job['id']}/events"), 404, job["id"])
    # And the other project's miss did not displace or poison the owner's entry.
    assert api.client.get(f"{JOBS}/{job['id']}").json() == owner_view.json()


def test_pollers_see_changes_within_the_ttl_and_their_own_cancel_at_once(api):
    clock = _frozen(api)
    job = created_job(api)
    path = f"{JOBS}/{job['id']}"
    assert api.client.get(path).json()["status"] == "queued"
    before = api.client.get(f"{path}/events").json()["data"]
    with api.session() as s:
        epoch = job_lease.claim(s, job["id"], "w", ttl_s=60)
        job_records.record_step(s, job["id"], epoch, 1, {"loss": 1.0}, trained_tokens=1, ttl_s=60)
        jobs_repo.add_event(s, job["id"], "a worker's news")
        s.commit()

    # Within poll_cache_s the cached answers stand (one query per job per second, not one per poller) ...
    assert api.client.get(path).json()["status"] == "queued"
    assert api.client.get(f"{path}/events").json()["data"] == before
    # ... and once it has passed, the worker's changes show.
    clock.t += api.app.state.settings.poll_cache_s
    fresh = api.client.get(path).json()
    assert (fresh["status"], fresh["steps_done"]) == ("running", 1)
    assert "a worker's news" in [e["message"] for e in api.client.get(f"{path}/events").json()["data"]]

    # A control action through the API forgets the job's entries: the caller's next GET sees it.
    assert api.client.post(f"{path}/cancel").status_code == 200
    events = [e["message"] for e in api.client.get(f"{path}/events").json()["data"]]
    assert any(m.startswith("Cancellation requested") for m in events), events


def test_a_revoked_key_is_refused_once_auth_cache_s_has_passed(api):
    clock = _frozen(api)
    assert api.client.get("/v1/files").status_code == 200
    with api.session() as s:
        (key, _), = projects.keys(s, "alpha")
        projects.revoke(s, key.id)
        s.commit()
    # The documented bound: a key found less than auth_cache_s ago is still accepted ...
    assert api.client.get("/v1/files").status_code == 200
    # ... and refused once it has passed.
    clock.t += api.app.state.settings.auth_cache_s
    assert_error(api.client.get("/v1/files"), 401, "invalid API key")
    assert api.other.get("/v1/files").status_code == 200


def test_a_load_that_raced_a_control_action_is_not_kept():
    clock = Clock()

    def ticking() -> float:
        clock.t += 0.001
        return clock.t

    cache = PollCache(1.0, clock=ticking)
    loads = []

    def load() -> bytes:
        loads.append(1)
        if len(loads) == 1:
            from_thread.run_sync(cache.forget, "p", "j")  # a cancel commits while this read is in flight
        return b"%d" % len(loads)

    async def main() -> list[bytes]:
        return [await cache.get("p", "j", "job", load) for _ in range(3)]

    assert anyio.run(main) == [b"1", b"2", b"2"]  # the second load was kept, the first was not


def test_a_job_seen_ending_is_never_followed_by_an_older_events_page(api):
    clock = _frozen(api)
    ttl = api.app.state.settings.poll_cache_s
    job = created_job(api)
    path = f"{JOBS}/{job['id']}"
    with api.session() as s:
        epoch = job_lease.claim(s, job["id"], "w", ttl_s=60)
        s.commit()
    assert api.client.get(path).json()["status"] == "running"  # the job's entry, loaded at t
    clock.t += ttl / 2
    assert api.client.get(f"{path}/events").status_code == 200  # the events page's, loaded at t + ttl/2
    with api.session() as s:  # the worker's last step and its end, in one commit as the job runner writes them
        jobs_repo.add_event(s, job["id"], "Step 1/1: loss=1")
        assert job_lease.finish(s, job["id"], epoch, "succeeded")
        jobs_repo.add_event(s, job["id"], "Job succeeded")
        s.commit()
    clock.t += ttl / 2 + 0.01  # the job's entry has expired; the events page's has not

    assert api.client.get(path).json()["status"] == "succeeded"
    events = [e["message"] for e in api.client.get(f"{path}/events").json()["data"]]
    assert events[:2] == ["Job succeeded", "Step 1/1: loss=1"]
    # Still a cache: the page just loaded is served again until the job is read anew.
    with api.session() as s:
        jobs_repo.add_event(s, job["id"], "later news")
        s.commit()
    assert [e["message"] for e in api.client.get(f"{path}/events").json()["data"]] == events


def test_an_events_page_whose_load_spanned_a_job_load_is_not_served_after_it():
    cache = PollCache(1.0, clock=lambda: 1000.0)  # nothing expires
    release, loads = threading.Event(), []

    def events() -> bytes:
        loads.append(1)
        if len(loads) == 1:
            release.wait(10)  # this read of the events happened before the job's, but ends after it
        return b"page %d" % len(loads)

    async def main() -> bytes:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(cache.get, "p", "j", ("events", None, 20), events)
            while not loads:
                await anyio.sleep(0.01)
            assert await cache.get("p", "j", "job", lambda: b"succeeded") == b"succeeded"
            release.set()
        return await cache.get("p", "j", ("events", None, 20), events)

    assert anyio.run(main) == b"page 2"
