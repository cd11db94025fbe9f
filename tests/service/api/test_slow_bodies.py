"""Slow request bodies (real sockets against a real uvicorn server) cannot take the API from other tenants.

A body is received before its request takes an admission place, under a minimum rate and a deadline, and a
project has a cap on uploads in flight (service/api/body_spool.py).
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack, contextmanager

import httpx

from tests.service.api.conftest import LiveServer, jsonl, running_api
from tests.service.api.conftest import TRAIN_ROWS

BOUNDARY = "cispo-test-boundary"
LIMITS = dict(api_threads=2, uploads_per_project=3, body_grace_s=4.0, body_min_bytes_per_s=1000, body_timeout_s=60)


def multipart(content: bytes) -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"t.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()


@contextmanager
def upload_socket(base: str, key: str, length: int):
    """A connection that has sent an upload's headers (Content-Length `length`) and nothing of its body yet."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall((f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: {key}\r\n"
                  f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {length}\r\n\r\n")
                 .encode())
    try:
        yield sock
    finally:
        sock.close()


def answer(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@contextmanager
def live(postgres_url, tmp_path):
    with running_api(postgres_url, tmp_path, **LIMITS) as api, LiveServer(api.app) as base:
        keys = {name: getattr(api, name).headers["authorization"] for name in ("client", "other")}
        with httpx.Client(base_url=base, headers={"Authorization": keys["client"]}, timeout=5) as alpha, \
                httpx.Client(base_url=base, headers={"Authorization": keys["other"]}, timeout=5) as beta:
            yield base, keys, alpha, beta


def test_stalled_uploads_hold_no_admission_place_and_are_capped_per_project(postgres_url, tmp_path):
    with live(postgres_url, tmp_path) as (base, keys, alpha, beta), ExitStack() as stack:
        stalled = [stack.enter_context(upload_socket(base, keys["client"], 100_000)) for _ in range(3)]
        for sock in stalled:
            sock.sendall(multipart(b"")[:120])  # a little of the body, then nothing: more sockets than API threads
        time.sleep(0.5)
        started = time.monotonic()
        assert beta.get("/v1/files").status_code == 200  # old code: waits for an admission place (times out)
        assert alpha.get("/v1/files").status_code == 200
        assert time.monotonic() - started < 4  # well inside the 4 s grace: the stalled uploads still hold slots
        # The project's fourth upload in flight is refused at once, its body unread.
        with upload_socket(base, keys["client"], 100_000) as fourth:
            status, body = answer(fourth)
        assert status == 429 and "uploads: this project already runs 3" in body["error"]["message"], body
        # Another project is not held up by alpha's cap.
        assert beta.post("/v1/files", files={"file": ("t.jsonl", jsonl(TRAIN_ROWS), "application/jsonl")},
                         data={"purpose": "fine-tune"}).status_code == 200
        # Past the grace period at under the minimum rate, each stalled upload gets a 408 and its slot back.
        for sock in stalled:
            status, body = answer(sock)
            assert status == 408 and body["error"]["code"] == "request_timeout", body
            assert "slower than the minimum of 1000 bytes/s" in body["error"]["message"]
        r = alpha.post("/v1/files", files={"file": ("t.jsonl", jsonl(TRAIN_ROWS), "application/jsonl")},
                       data={"purpose": "fine-tune"})
        assert r.status_code == 200, r.text


def test_a_trickling_body_is_cut_off_but_a_slow_honest_one_is_taken(postgres_url, tmp_path):
    with live(postgres_url, tmp_path) as (base, keys, alpha, _):
        content = multipart(jsonl(TRAIN_ROWS * 40))  # ~4 KB/s over about 3 s: above the 1000 B/s minimum
        with upload_socket(base, keys["client"], len(content)) as honest:
            parts = [content[i:i + len(content) // 3 + 1] for i in range(0, len(content), len(content) // 3 + 1)]
            for part in parts:
                honest.sendall(part)
                time.sleep(1.0)
            status, body = answer(honest)
        assert status == 200 and body["bytes"] == len(jsonl(TRAIN_ROWS * 40)), body

        # A JSON body sent a byte every 0.3 s: past the 4 s grace it is under the rate, and refused.
        payload = json.dumps({"spec": {"type": "exact_match", "reference": "a"}, "completions": ["a"]}).encode()
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall((f"POST /v1/reward_functions/test HTTP/1.1\r\nHost: {host}\r\n"
                          f"Authorization: {keys['client']}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n").encode())
            started = time.monotonic()
            sock.settimeout(0.3)
            status = None
            for byte in payload:
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.3)
                except OSError:
                    break
                if time.monotonic() - started > 6:
                    break
            sock.settimeout(30)
            status, body = answer(sock)
        assert status == 408 and "the request body did not arrive in time" in body["error"]["message"], body
        assert time.monotonic() - started < 12
        assert alpha.get("/v1/files").status_code == 200
