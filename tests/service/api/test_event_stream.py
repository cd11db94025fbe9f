"""GET /v1/fine_tuning/jobs/{id}/events?stream=true: server-sent events over a real HTTP server.

Events arrive oldest first with their ids, a reconnect with Last-Event-ID resumes after it, the stream
ends when the job does, and many open streams hold neither database connections nor the thread pool.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from sqlalchemy import update

from service.db.models import Job, now
from service.repositories import jobs as jobs_repo
from tests.service.api.conftest import assert_error, created_job
from tests.service.api.uvicorn_thread import serving


def read_stream(response, *, until_end: bool = True, count: int | None = None, timeout: float = 20) -> list[dict]:
    """SSE messages as dicts (id, event, data), until `end` or `count` data messages."""
    messages, current, deadline = [], {}, time.monotonic() + timeout
    for line in response.iter_lines():
        assert time.monotonic() < deadline, "the stream did not end in time"
        if line == "":
            if "event" in current:
                messages.append(current)
                if current["event"] == "end" or (count is not None and len(messages) == count):
                    return messages
            current = {}
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(": ")
            current[key] = json.loads(value) if key == "data" else value
    assert not until_end, "the stream closed without an end message"
    return messages


@pytest.fixture
def live(api):
    with serving(api.app) as base:
        headers = {"Authorization": api.client.headers["Authorization"]}
        with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(20)) as http:
            yield api, http


def _finish(api, job_id: str, delay: float) -> threading.Thread:
    """As a worker would: a few events (one a metrics event), then the last event with the terminal status."""
    def run():
        time.sleep(delay)
        with api.session() as s:
            jobs_repo.add_event(s, job_id, "Step 1/3", type="metrics", data={"step": 1, "loss": 0.5})
            jobs_repo.add_event(s, job_id, "Checkpoint saved at step 1")
            s.commit()
        time.sleep(delay)
        with api.session() as s:
            s.execute(update(Job).where(Job.id == job_id).values(status="succeeded", finished_at=now()))
            jobs_repo.add_event(s, job_id, "Job succeeded")
            s.commit()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_stream_follows_a_job_to_its_end_and_resumes_after_last_event_id(live):
    api, http = live
    job_id = created_job(api)["id"]
    writer = _finish(api, job_id, 0.5)
    with http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events", params={"stream": "true"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        messages = read_stream(r)
    writer.join(10)
    # step progress (the metrics events) streams by default
    assert [m["data"].get("message") for m in messages] == ["Job created", "Step 1/3", "Checkpoint saved at step 1",
                                                             "Job succeeded", None]
    assert messages[1]["data"]["data"] == {"step": 1, "loss": 0.5}
    assert messages[-1] == {"event": "end", "data": {"status": "succeeded"}}
    assert all(m["id"] == m["data"]["id"] and m["event"] == "fine_tuning.job.event" for m in messages[:-1])

    # a reconnect resumes right after the last event it saw; include_metrics=false leaves the step events out
    with http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events",
                     params={"stream": "true", "include_metrics": "false"},
                     headers={"Last-Event-ID": messages[0]["id"]}) as r:
        resumed = read_stream(r)
    assert [m["data"].get("message") for m in resumed] == ["Checkpoint saved at step 1", "Job succeeded", None]


def test_an_unknown_last_event_id_or_job_is_refused(live, api):
    api, http = live
    job_id = created_job(api)["id"]
    other = created_job(api)["id"]
    with api.session() as s:
        foreign = jobs_repo.events(s, other, after=None, limit=1).items[0].id
    r = http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"stream": "true"},
                 headers={"Last-Event-ID": foreign})
    assert_error(r, 400, "Last-Event-ID")
    assert api.other.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"stream": "true"}).status_code == 404


def test_open_streams_hold_no_connection_and_do_not_starve_other_requests(live):
    api, http = live
    job_id = created_job(api)["id"]
    n = 50  # more than the thread pool (40) and the connection pool (5 + 10 overflow)
    ready, release, errors = threading.Barrier(n + 1, timeout=60), threading.Event(), []

    def hold_open():
        try:
            with http.stream("GET", f"/v1/fine_tuning/jobs/{job_id}/events", params={"stream": "true"}) as r:
                assert read_stream(r, count=1, until_end=False)[0]["data"]["message"] == "Job created"
                ready.wait()
                release.wait(30)
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)
            ready.abort()

    threads = [threading.Thread(target=hold_open) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        ready.wait()
        pool = api.app.state.sessions.kw["bind"].pool
        checked_out = []
        for _ in range(20):  # streams poll every second; sample across a few polls
            checked_out.append(pool.checkedout())
            time.sleep(0.1)
        started = time.monotonic()
        r = http.get(f"/v1/fine_tuning/jobs/{job_id}")
        elapsed = time.monotonic() - started
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert r.status_code == 200 and elapsed < 3, elapsed
    assert max(checked_out) <= 5, checked_out  # polls borrow a connection for a moment and give it back
