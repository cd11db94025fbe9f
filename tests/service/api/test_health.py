"""Probes, and the API's promise to start without torch or the worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from service.api.app import create_app
from service.sandbox.probe import probe
from tests.service.api.conftest import make_settings

from tests.conftest import REDIS_TEST_URL as REDIS_URL


def test_healthz_needs_no_key(api):
    r = api.anonymous.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_readyz_checks_database_broker_and_store(database_url, tmp_path):
    app = create_app(make_settings(database_url, tmp_path, BROKER_URL=REDIS_URL), enqueue=lambda _: None)
    r = TestClient(app).get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready", "checks": {"database": "ok", "broker": "ok", "object_store": "ok",
                                                      "sandbox": probe().level}}


def test_readyz_reports_the_sandbox_without_failing_on_it(database_url, tmp_path):
    app = create_app(make_settings(database_url, tmp_path, BROKER_URL=REDIS_URL, sandbox="off"),
                     enqueue=lambda _: None)
    r = TestClient(app).get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["checks"]["sandbox"] == "none"  # user code refused; the API is still ready


def test_readyz_is_503_naming_what_failed(database_url, tmp_path):
    dead_broker = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    app = create_app(make_settings(database_url, tmp_path, BROKER_URL=dead_broker), enqueue=lambda _: None)
    Path(app.state.store.root).rmdir()  # the local store's directory is gone
    r = TestClient(app).get("/readyz")
    assert r.status_code == 503
    assert r.json() == {"status": "not_ready", "checks": {"database": "ok", "broker": "failed",
                                                          "object_store": "failed", "sandbox": probe().level}}


def test_importing_the_api_loads_neither_torch_nor_the_worker():
    code = ("import service.api.app, sys; "
            "assert 'torch' not in sys.modules and not any(m.startswith('worker') for m in sys.modules)")
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
