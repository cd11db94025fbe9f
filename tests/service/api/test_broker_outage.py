"""A Redis that accepts connections but never answers, met by the real API process over real HTTP:
creating a job still answers quickly (the row stays queued for the reconciler) and /readyz says the
broker is down instead of hanging."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import redis

from service.queue import JOBS_QUEUE
from service.settings import Settings
from tests.service.api.conftest import TRAIN_ROWS, cispo_body, jsonl
from tests.service.api.live_server import live_api
from tests.conftest import REDIS_TEST_URL
from tests.tcp_proxy import TcpProxy
from worker.jobs.reconciler import reconcile_once


def _timed(call):
    t = time.monotonic()
    response = call()
    return response, time.monotonic() - t


def test_a_stalled_broker_neither_hangs_job_creation_nor_readyz(tmp_path):
    url = urlsplit(REDIS_TEST_URL)
    redis.Redis.from_url(REDIS_TEST_URL).delete(JOBS_QUEUE)
    with TcpProxy(url.hostname, url.port) as proxy, \
            live_api(tmp_path, BROKER_URL=f"redis://127.0.0.1:{proxy.port}{url.path}", CISPO_BROKER_TIMEOUT_S="2",
                     CISPO_MODEL_DIRS=str(tmp_path), CISPO_MODEL_HUB_URL="") as live, live.client() as client:
        train = client.post("/v1/files", files={"file": ("train.jsonl", jsonl(TRAIN_ROWS))},
                            data={"purpose": "fine-tune"}).json()["id"]
        healthy = client.post("/v1/fine_tuning/jobs", json=cispo_body(train))  # warms the API's broker pool
        assert healthy.status_code == 200, healthy.text
        assert client.get("/readyz").json()["checks"]["broker"] == "ok"

        proxy.stall()  # connections open, no byte answered: a hung Redis
        try:
            created, took = _timed(lambda: client.post("/v1/fine_tuning/jobs", json=cispo_body(train)))
            assert created.status_code == 200 and created.json()["status"] == "queued", created.text
            assert took < 4.5, f"job creation waited {took:.1f} s on the stalled broker"
            ready, took = _timed(lambda: client.get("/readyz"))
            assert ready.status_code == 503 and ready.json()["checks"]["broker"] == "failed", ready.text
            assert took < 4.5, f"/readyz waited {took:.1f} s on the stalled broker"
        finally:
            proxy.unstall()

        # Not an orphan: the reconciler's next pass sends the queued job once the broker answers again,
        # not its resend of old queued jobs (minutes later).
        settings = Settings(DATABASE_URL=live.database_url, BROKER_URL=REDIS_TEST_URL)
        assert reconcile_once(settings) == [created.json()["id"]]
        assert reconcile_once(settings) == []  # owed once, sent once
        queued = redis.Redis.from_url(REDIS_TEST_URL).lrange(JOBS_QUEUE, 0, -1)
        assert any(created.json()["id"].encode() in m for m in queued)


def _failing(job_id: str) -> None:
    raise ConnectionError("the broker is down")


def test_a_job_whose_message_failed_is_sent_on_the_reconcilers_next_pass(api, monkeypatch):
    from service.repositories import job_lease, jobs as jobs_repo
    from tests.service.api.conftest import created_job
    from worker.jobs import reconciler

    api.app.state.enqueue = _failing  # the broker is down when the API enqueues
    job = created_job(api)
    assert job["status"] == "queued"
    paused = created_job(api)
    api.app.state.enqueue = api.enqueued
    assert api.client.post(f"/v1/fine_tuning/jobs/{paused['id']}/pause").status_code == 200
    api.app.state.enqueue = _failing
    assert api.client.post(f"/v1/fine_tuning/jobs/{paused['id']}/resume").json()["status"] == "queued"

    sent = []
    monkeypatch.setattr(reconciler, "enqueue_job", lambda job_id, delay_s=0.0, settings=None: sent.append(job_id))
    settings = api.app.state.settings
    assert sorted(reconciler.reconcile_once(settings)) == sorted([job["id"], paused["id"]])  # not in 300 s: now
    assert reconciler.reconcile_once(settings) == [] and len(sent) == 2  # and once

    # A pass that cannot send either keeps the job owed; the next one sends it.
    api.app.state.enqueue = _failing
    third = created_job(api)
    monkeypatch.setattr(reconciler, "enqueue_job", lambda job_id, delay_s=0.0, settings=None: _failing(job_id))
    assert reconciler.reconcile_once(settings) == []
    monkeypatch.setattr(reconciler, "enqueue_job", lambda job_id, delay_s=0.0, settings=None: sent.append(job_id))
    assert reconciler.reconcile_once(settings) == [third["id"]]
    with api.session() as s:  # a job that runs owes nothing, whoever sent it
        assert job_lease.claim(s, third["id"], "w", ttl_s=60)
        assert jobs_repo.get_for_worker(s, third["id"]).enqueue_failed_at is None
