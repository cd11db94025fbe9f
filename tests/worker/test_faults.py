"""Faults the production stack meets, injected for real: a forked worker child, a stalled Redis,
an object store that goes away mid-job, a worker frozen (SIGSTOP) past its lease."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest
from sqlalchemy import select, text

from service.db.models import Checkpoint
from service.db.session import session_factory
from service.queue import enqueue_job, make_celery
from service.settings import Settings
from service.storage import open_store
from tests.conftest import BUCKET, REDIS_TEST_URL
from tests.tcp_proxy import TcpProxy
from tests.worker.test_job_runner import job_row, submit
from worker.job_runner import run_job


def _backend_pid_in_child(url: str, out) -> None:
    with session_factory(url).begin() as s:
        out.put(s.scalar(text("SELECT pg_backend_pid()")))


def test_a_forked_child_never_reuses_the_parents_database_connection(postgres_url):
    # The reconciler runs in the Celery parent; prefork children used its pooled connection.
    with session_factory(postgres_url).begin() as s:
        parent = s.scalar(text("SELECT pg_backend_pid()"))
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_backend_pid_in_child, args=(postgres_url, out))
    child.start()
    child_pid = out.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0
    assert child_pid != parent  # its own server session, not the parent's socket
    with session_factory(postgres_url).begin() as s:  # and the parent's connection still works
        assert s.scalar(text("SELECT pg_backend_pid()")) == parent


def test_a_stalled_broker_fails_sends_and_pings_quickly():
    host, port = "127.0.0.1", int(urlsplit(REDIS_TEST_URL).port)
    with TcpProxy(host, port) as proxy:
        settings = Settings(broker_url=f"redis://127.0.0.1:{proxy.port}/{REDIS_TEST_URL.rsplit('/', 1)[1]}",
                            broker_timeout_s=1)
        enqueue_job("ftjob-healthy", settings=settings)  # through the proxy, while Redis answers
        proxy.stall()  # accepts, never answers: without socket timeouts both calls below hang forever
        for attempt in (lambda: enqueue_job("ftjob-stalled", settings=settings),
                        lambda: make_celery(settings).connection_for_write().ensure_connection(max_retries=1,
                                                                                             timeout=1)):
            t = time.monotonic()
            with pytest.raises(Exception):
                attempt()
            assert time.monotonic() - t < 10
        proxy.unstall()


def _s3_settings(tmp_path, database_url, s3_url, **kw) -> Settings:
    return Settings(home=tmp_path / "home", database_url=database_url, storage_url=s3_url,
                    heartbeat_s=0.2, lease_ttl_s=30, retry_backoff_s=0, **kw)


def _through(proxy: TcpProxy, s3_url: str) -> str:
    return s3_url.replace(f"endpoint_url=http://127.0.0.1:{proxy.target_port}",
                          f"endpoint_url=http://127.0.0.1:{proxy.port}")


def _wait_for_checkpoint(settings, job_id, step, timeout=120):
    deadline = time.time() + timeout
    while True:
        with session_factory(settings.resolved_database_url()).begin() as s:
            if s.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job_id, Checkpoint.step == step)):
                return
        assert time.time() < deadline, f"no checkpoint at step {step}"
        time.sleep(0.05)


@pytest.mark.slow
def test_an_object_store_outage_retries_the_job_from_its_last_checkpoint(postgres_url, s3_url, moto_endpoint,
                                                                        toy_dir, tmp_path):
    import threading

    port = int(urlsplit(moto_endpoint).port)
    proxy = TcpProxy("127.0.0.1", port).start()
    try:
        settings = _s3_settings(tmp_path, postgres_url, _through(proxy, s3_url))
        job_id = submit(settings, toy_dir, steps=4)
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("status", run_job(job_id, settings)))
        worker.start()
        _wait_for_checkpoint(settings, job_id, 2)
        proxy.kill()  # the store goes away: the step-4 upload fails (after the client's own retries)
        worker.join(180)
        assert out["status"] == "queued"  # not failed: another attempt may well succeed
        job = job_row(settings, job_id)
        assert (job.status, job.attempts, job.error_code) == ("queued", 1, None)

        proxy = TcpProxy("127.0.0.1", port, port=proxy.port).start()  # the store is back
        assert run_job(job_id, settings) == "succeeded"
        job = job_row(settings, job_id)
        assert (job.status, job.attempts, job.steps_done) == ("succeeded", 2, 4)
        from service.db.models import JobEvent

        with session_factory(postgres_url).begin() as s:
            messages = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
        assert any("storage_unavailable" in m and "runs again" in m for m in messages)
        assert "Resumed from the checkpoint at step 2" in messages
    finally:
        proxy.kill()
