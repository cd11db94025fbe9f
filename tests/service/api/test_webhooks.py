"""Signed webhooks for job outcomes, against a real HTTP receiver on loopback.

The receiver is a plain http.server that verifies nothing itself; the tests verify the Standard Webhooks
signature independently, and count what the receiver would process (deduped by webhook-id).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import create_engine, event, func, insert, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from service import webhooks
from service.db.models import Job, WebhookDelivery, WebhookEndpoint
from service.egress import EgressPolicy
from service.repositories import job_lease
from service.repositories import webhooks as webhooks_repo
from tests.service.api.conftest import assert_error, created_job, running_api
from tests.conftest import free_port

LOOPBACK = EgressPolicy.from_setting("127.0.0.1")
FAST = webhooks.Backoff(base_s=0.0)


class Receiver:
    def __init__(self, port: int, *, fail_first: int = 0, delay_s: float = 0.0):
        self.port, self.fail_first, self.delay_s = port, fail_first, delay_s
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def processed(self) -> dict[str, dict]:
        """What a receiver that dedupes on webhook-id would act on: each id once, from its first 2xx."""
        return {r["headers"]["webhook-id"]: r for r in reversed(self.requests) if r["status"] == 200}

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(receiver.delay_s)
                with receiver.lock:
                    status = 500 if receiver.fail_first > 0 else 200
                    receiver.fail_first -= 1
                    receiver.requests.append({"headers": {k.lower(): v for k, v in self.headers.items()},
                                              "body": body, "status": status})
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def receiver(**kw):
    r = Receiver(free_port(), **kw)
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def hooks(database_url, tmp_path):
    with running_api(database_url, tmp_path, egress_allow="127.0.0.1") as api:
        yield api


def verify(secret: str, request: dict) -> dict:
    """Standard Webhooks verification, written out independently of the service's code."""
    h = request["headers"]
    key = base64.b64decode(secret.split("_", 1)[1])
    signed = f"{h['webhook-id']}.{h['webhook-timestamp']}.".encode() + request["body"]
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    assert h["webhook-signature"] == f"v1,{expected}"
    assert abs(int(h["webhook-timestamp"]) - time.time()) < 60
    return json.loads(request["body"])


def register(api, url: str, **extra) -> dict:
    r = api.client.post("/v1/webhook_endpoints", json={"url": url, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def end_three_jobs(api) -> dict[str, str]:
    """job id -> how it ended, each through the code path that really ends jobs that way."""
    ended = {}
    cancelled = created_job(api)["id"]
    assert api.client.post(f"/v1/fine_tuning/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
    ended[cancelled] = "fine_tuning.job.cancelled"
    failed, succeeded = created_job(api)["id"], created_job(api)["id"]
    with api.session() as s:
        failing = job_lease.claim(s, failed, "worker-1", 30)
        assert job_lease.finish(s, failed, failing, "failed", error_code="training_error", error_message="gave up")
        epoch = job_lease.claim(s, succeeded, "worker-1", 30)
        assert job_lease.finish(s, succeeded, epoch, "succeeded")
        s.commit()
    ended[failed], ended[succeeded] = "fine_tuning.job.failed", "fine_tuning.job.succeeded"
    return ended


def dispatch_until(api, done, *, backoff=FAST, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "deliveries did not arrive in time"
        webhooks.dispatch_once(api.app.state.sessions, LOOPBACK, backoff=backoff)
        time.sleep(0.05)


def test_registration_checks_the_url_and_shows_the_secret_once(api, hooks):
    assert_error(api.client.post("/v1/webhook_endpoints", json={"url": "http://127.0.0.1:9/x"}), 400, "url: ",
                 "non-public address")  # loopback without the operator's allow-list
    assert_error(api.client.post("/v1/webhook_endpoints", json={"url": "ftp://example.com/x"}), 400, "url")
    assert_error(hooks.client.post("/v1/webhook_endpoints", json={"url": "http://127.0.0.1:9/x",
                                                                  "events": ["fine_tuning.job.paused"]}), 400, "events")
    created = register(hooks, "http://127.0.0.1:9/x")
    assert created["secret"].startswith("whsec_") and len(base64.b64decode(created["secret"][6:])) == 32
    assert created["events"] == ["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]
    shown = hooks.client.get(f"/v1/webhook_endpoints/{created['id']}").json()
    assert shown["secret"] is None and shown["url"] == created["url"]
    assert hooks.client.get("/v1/webhook_endpoints").json()["data"][0]["secret"] is None
    assert hooks.other.get(f"/v1/webhook_endpoints/{created['id']}").status_code == 404
    assert hooks.other.delete(f"/v1/webhook_endpoints/{created['id']}").status_code == 404
    assert hooks.client.delete(f"/v1/webhook_endpoints/{created['id']}").json()["deleted"] is True


def test_outcomes_are_signed_retried_and_processed_once(hooks):
    with receiver(fail_first=4) as rx:
        endpoint = register(hooks, rx.url)
        ended = end_three_jobs(hooks)
        dispatch_until(hooks, lambda: len(rx.processed()) == 3)
        for _ in range(3):  # later passes send nothing more
            webhooks.dispatch_once(hooks.app.state.sessions, LOOPBACK, backoff=FAST)
        requests = list(rx.requests)
    assert len(requests) == 4 + 3  # four refusals retried, then one success per event
    events = {}
    for request in requests:
        event = verify(endpoint["secret"], request)
        assert event["id"] == request["headers"]["webhook-id"] and event["object"] == "event"
        events.setdefault(event["id"], set()).add((event["type"], event["data"]["id"]))
    # every attempt of one event carries the same id and payload
    assert sorted(next(iter(v)) for v in events.values()) == sorted((t, j) for j, t in ended.items())
    deliveries = hooks.client.get(f"/v1/webhook_endpoints/{endpoint['id']}/deliveries").json()["data"]
    assert {d["status"] for d in deliveries} == {"delivered"} and sum(d["attempts"] for d in deliveries) == 7


def test_a_receiver_that_is_down_gets_the_event_when_it_comes_back(hooks):
    port = free_port()
    endpoint = register(hooks, f"http://127.0.0.1:{port}/hooks")
    job_id = created_job(hooks)["id"]
    hooks.client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    backoff = webhooks.Backoff(base_s=1.0)
    webhooks.dispatch_once(hooks.app.state.sessions, LOOPBACK, backoff=backoff)  # nobody listens
    [pending] = hooks.client.get(f"/v1/webhook_endpoints/{endpoint['id']}/deliveries").json()["data"]
    assert (pending["status"], pending["attempts"]) == ("pending", 1)
    assert "ConnectError" in pending["last_error"] and pending["next_attempt_at"] >= time.time() - 1
    assert webhooks.dispatch_once(hooks.app.state.sessions, LOOPBACK, backoff=backoff) == 0  # backing off

    rx = Receiver(port)
    rx.start()
    try:
        dispatch_until(hooks, lambda: len(rx.processed()) == 1, backoff=backoff)
    finally:
        rx.stop()
    event = verify(endpoint["secret"], rx.requests[0])
    assert (event["type"], event["data"]["id"], event["id"]) == ("fine_tuning.job.cancelled", job_id, pending["id"])


def test_concurrent_senders_send_each_attempt_once(hooks):
    with receiver(delay_s=0.3) as rx:
        register(hooks, rx.url)
        end_three_jobs(hooks)
        senders = [threading.Thread(target=webhooks.dispatch_once, args=(hooks.app.state.sessions, LOOPBACK))
                   for _ in range(3)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(30)
        ids = [r["headers"]["webhook-id"] for r in rx.requests]
    assert len(ids) == 3 and len(set(ids)) == 3


def test_a_delivery_is_given_up_after_the_last_attempt(hooks, monkeypatch):
    monkeypatch.setattr(webhooks, "MAX_ATTEMPTS", 3)
    with receiver(fail_first=100) as rx:
        endpoint = register(hooks, rx.url, events=["fine_tuning.job.cancelled"])
        end_three_jobs(hooks)  # only the cancelled one is subscribed
        for _ in range(6):
            webhooks.dispatch_once(hooks.app.state.sessions, LOOPBACK, backoff=FAST)
        assert len(rx.requests) == 3
    [failed] = hooks.client.get(f"/v1/webhook_endpoints/{endpoint['id']}/deliveries").json()["data"]
    assert (failed["status"], failed["attempts"], failed["last_error"]) == ("failed", 3, "HTTP 500")


def test_a_pass_reads_only_pending_jobs_and_deliveries_not_the_old_finished_ones(hooks):
    """2000 jobs that ended an hour ago, each delivered long since, then two new outcomes: a pass reads
    the two (PostgreSQL: the rows this transaction fetched from each table; SQLite: every query on the
    two tables searches a pending-only index instead of scanning)."""
    endpoint = register(hooks, "http://127.0.0.1:9/hooks")
    engine = hooks.app.state.sessions.kw["bind"]
    with hooks.session() as s:
        template = dict(s.execute(select(Job.__table__).where(Job.id == created_job(hooks)["id"])).mappings().one())
        del template["seq"]  # numbered by the database
        old = int(time.time()) - 3600
        s.execute(update(WebhookEndpoint).where(WebhookEndpoint.id == endpoint["id"]).values(created_at=old - 60))
        s.execute(insert(Job.__table__), [{**template, "id": f"ftjob-old{i:05d}", "status": "succeeded",
                                           "finished_at": old, "idempotency_key": None} for i in range(2000)])
        s.commit()
    with hooks.app.state.sessions.begin() as s:  # earlier passes: the backlog made into deliveries ...
        assert webhooks_repo.enqueue_outcomes(s, webhooks.EVENT_TYPES, limit=5000) == 2000
        s.execute(update(WebhookDelivery).values(delivered_at=old))  # ... long delivered
    with hooks.session() as s:
        assert s.scalar(select(func.count()).where(Job.webhooks_enqueued_at.is_(None),
                                                   Job.finished_at.is_not(None))) == 0
    new = [created_job(hooks)["id"] for _ in range(2)]
    for job_id in new:
        hooks.client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    postgres = engine.dialect.name == "postgresql"
    if postgres:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE job; ANALYZE webhook_delivery"))
            conn.commit()

    # A connection of its own: PostgreSQL counts a connection's reads until it reports them, which may be
    # after several transactions, so a pooled one could show earlier work.
    engine = create_engine(hooks.database_url, poolclass=NullPool)
    statements = []
    listen = lambda conn, cursor, statement, params, context, many: statements.append((statement, params))  # noqa
    event.listen(engine, "before_cursor_execute", listen)
    try:
        with Session(engine) as s, s.begin():
            webhooks_repo.enqueue_outcomes(s, webhooks.EVENT_TYPES)  # what dispatch_once's first transaction does
            due = webhooks_repo.due(s, 100)
            if postgres:
                read = dict(s.execute(text(
                    "SELECT relname, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
                    "FROM pg_stat_xact_user_tables WHERE relname IN ('job', 'webhook_delivery')")).all())
    finally:
        event.remove(engine, "before_cursor_execute", listen)
        engine.dispose()
    assert len(due) == 2
    if postgres:
        # The two new jobs (read, then checked by the new deliveries' foreign keys) and the two deliveries;
        # the old code read every one of the 2000 finished jobs and their deliveries on every pass.
        assert read["job"] <= 8 and read["webhook_delivery"] <= 8, read
    else:
        with engine.connect() as conn:
            for statement, params in statements:
                if statement.lstrip().upper().startswith("SELECT") and ("FROM job" in statement
                                                                          or "FROM webhook_delivery" in statement):
                    plan = " / ".join(r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params))
                    assert "_pending" in plan and "SCAN" not in plan, (statement, plan)


def test_an_allow_list_entry_with_a_port_keeps_webhooks_off_the_hosts_other_ports(database_url, tmp_path):
    with running_api(database_url, tmp_path, egress_allow="127.0.0.1:8009") as api:
        assert_error(api.client.post("/v1/webhook_endpoints", json={"url": "http://127.0.0.1:6379/"}), 400, "url: ",
                     "non-public address")  # Redis's port next to the allowed receiver
        register(api, "http://127.0.0.1:8009/hooks")
