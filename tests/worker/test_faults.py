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
