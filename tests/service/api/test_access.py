"""Access: authentication before the body is read, key revocation, and the per-key rate limit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import anyio
import pytest

from service.api.app import create_app
from service.db.session import session_factory
from tests.service.api.conftest import assert_error, make_settings, running_api, uploaded


def _send_upload(app, *, authorization: bytes | None, total: int, chunk: int = 64 * 1024) -> tuple[int, int]:
    """POST a multipart upload of `total` bytes straight into the ASGI app; (status, bytes the app read)."""
    headers = [(b"content-type", b"multipart/form-data; boundary=xyz"), (b"content-length", str(total).encode())]
    if authorization:
        headers.append((b"authorization", authorization))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/files", "raw_path": b"/v1/files", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("test", 80)}
    sent, status = 0, []

    async def receive():
        nonlocal sent
        if sent >= total:
            return {"type": "http.disconnect"}
        part = min(chunk, total - sent)
        sent += part
        return {"type": "http.request", "body": b"x" * part, "more_body": sent < total}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    async def serve():
        app.state.admission = anyio.Semaphore(4)  # what the lifespan makes; not run for one raw ASGI call
        await app(scope, receive, send)

    asyncio.run(serve())
    return status[0], sent


@pytest.mark.parametrize("authorization", [None, b"Bearer sk-cispo-not-a-key"])
def test_an_unauthenticated_upload_is_refused_before_its_body_is_read(tmp_path, authorization):
    from tests.conftest import make_database

    url, drop = make_database("sqlite", tmp_path)
    try:
        app = create_app(make_settings(url, tmp_path, max_upload_bytes=64 << 20), enqueue=lambda _: None)
        status, read = _send_upload(app, authorization=authorization, total=8 << 20)
        assert status == 401
        assert read == 0  # not one byte of the 8 MB was consumed
    finally:
        session_factory(url).kw["bind"].dispose()
        drop()


def test_a_revoked_key_is_refused_within_auth_cache_s_and_the_cli_lists_and_revokes(api, tmp_path):
    assert api.client.get("/v1/files").status_code == 200
    env = {"CISPO_DATABASE_URL": api.database_url, "CISPO_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"}

    def cispo(*args):
        return subprocess.run([sys.executable, "-m", "worker.cli", "keys", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    listed = cispo("list", "--project", "alpha")
    assert listed.returncode == 0, listed.stderr
    lines = [line for line in listed.stdout.splitlines() if line.startswith("key_")]
    assert len(lines) == 1 and "alpha" in lines[0] and "active" in lines[0]
    key_id = lines[0].split()[0]

    revoked = cispo("revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    time.sleep(api.app.state.settings.auth_cache_s)  # the documented bound (tests/service/api/test_poll_cache.py)
    assert_error(api.client.get("/v1/files"), 401, "invalid API key")
    assert api.other.get("/v1/files").status_code == 200  # other keys are untouched
    assert "revoked" in cispo("list", "--project", "alpha").stdout
    unknown = cispo("revoke", "key_doesnotexist")
    assert unknown.returncode != 0 and "no such key" in unknown.stderr


def test_a_key_over_its_rate_gets_429_with_retry_after_and_others_are_unaffected(database_url, tmp_path):
    with running_api(database_url, tmp_path, rate_limit_per_s=0.5, rate_limit_burst=3) as api:
        for _ in range(3):
            assert api.client.get("/v1/files").status_code == 200
        r = api.client.get("/v1/files")
        assert_error(r, 429, "rate limit")
        assert 1 <= int(r.headers["retry-after"]) <= 2
        assert api.other.get("/v1/files").status_code == 200  # the limit is per key, not global


def test_uploads_still_work_for_an_authenticated_key(api):
    assert uploaded(api.client).startswith("file-")
