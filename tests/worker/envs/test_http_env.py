"""Remote HTTP environments against a real server on loopback (allow-listed like an in-cluster service)."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import pytest

from service.egress import EgressPolicy, EgressRefused
from service.schemas.environments import HttpEnvironment
from tests.loopback_http import QuietHandler, base_url, serving
from worker.envs import make_environment

LOOPBACK = EgressPolicy.from_setting("127.0.0.1")


class _Handler(QuietHandler):
    """POST /<mode>/reset and /<mode>/step; mode 'good' counts to 2, the others misbehave as named."""

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode, op = self.path.strip("/").split("/")
        server.requests.append({"mode": mode, "op": op, "body": body, "auth": self.headers.get("Authorization")})
        episode = body["episode_id"]
        if op == "reset":
            if mode == "flaky" and server.failures.get(episode, 0) < 2:
                server.failures[episode] = server.failures.get(episode, 0) + 1
                return self.answer(503, b'{"error": "warming up"}')
            server.turns[episode] = 0
            question = body["row"].get("q", body["row"].get("prompt"))
            return self.answer(200, json.dumps({"observation": f"seed {body['seed']}: {question}"}).encode())
        if mode == "slow":
            time.sleep(1.5)
        if mode == "garbage":
            return self.answer(200, b"<html>not json</html>")
        if mode == "shape":
            return self.answer(200, json.dumps({"observation": "x", "reward": "lots"}).encode())
        if mode == "big":
            return self.answer(200, json.dumps({"observation": "x" * 2_000_000, "reward": 1, "terminated": False,
                                               "truncated": False}).encode())
        if mode == "error":
            return self.answer(500, b'{"error": "boom"}')
        server.turns[episode] += 1
        done = server.turns[episode] >= 2
        answer = {"observation": None if done else f"you said {body['action']}", "reward": 0.5,
                  "terminated": done, "truncated": False, "info": {"turn": server.turns[episode]}}
        self.answer(200, json.dumps(answer).encode())


@contextmanager
def env_server():
    with serving(_Handler) as server:
        server.requests, server.turns, server.failures = [], {}, {}
        yield base_url(server), server


def _env(base: str, mode: str, **kw):
    return make_environment(HttpEnvironment(url=f"{base}/{mode}/", **kw), egress=LOOPBACK,
                            secrets={"env-key": "Bearer s3cret"})


def test_episodes_over_http_with_the_secret_header():
    with env_server() as (base, server):
        env = _env(base, "good", auth_secret="env-key")
        try:
            resets = env.reset([("e1", 5, {"q": "hi"}), ("e2", 6, {"q": "yo"})])
            assert [r.observation for r in resets] == ["seed 5: hi", "seed 6: yo"]
            first = env.step([("e1", "a"), ("e2", "b")])
            assert [o.observation for o in first] == ["you said a", "you said b"]
            assert [o.reward for o in first] == [0.5, 0.5] and not any(o.done for o in first)
            second = env.step([("e1", "c")])[0]
            assert second.terminated and second.observation is None and second.error is None
        finally:
            env.close()
        assert {r["auth"] for r in server.requests} == {"Bearer s3cret"}
        assert {"episode_id": "e1", "seed": 5, "row": {"q": "hi"}} in [r["body"] for r in server.requests]
        assert {"episode_id": "e1", "action": "c"} in [r["body"] for r in server.requests]


def test_a_slow_server_times_out_that_episode():
    with env_server() as (base, server):
        env = _env(base, "slow", timeout_s=0.3, max_retries=2)
        env.reset([("e1", 0, {"q": "x"})])
        started = time.monotonic()
        outcome = env.step([("e1", "a")])[0]
        assert outcome.error is not None and "timeout" in outcome.error
        assert time.monotonic() - started < 1.4
        # A step that may have reached the server is never retried (it is not idempotent).
        assert sum(1 for r in server.requests if r["op"] == "step") == 1
        env.close()


@pytest.mark.parametrize("mode, needle", [
    ("garbage", "not JSON"),
    ("shape", "bad answer"),
    ("big", "larger than"),
    ("error", "HTTP 500"),
])
def test_garbage_answers_fail_the_episode_not_the_job(mode, needle):
    with env_server() as (base, server):
        env = _env(base, mode)
        env.reset([("e1", 0, {"q": "x"})])
        outcome = env.step([("e1", "a")])[0]
        assert outcome.error is not None and needle in outcome.error, outcome.error
        env.close()


def test_reset_is_retried_on_5xx():
    with env_server() as (base, server):
        env = _env(base, "flaky", max_retries=2)
        assert env.reset([("e1", 0, {"q": "x"})])[0].observation == "seed 0: x"
        assert [r["op"] for r in server.requests] == ["reset"] * 3
        env.close()
    with env_server() as (base, server):
        env = _env(base, "flaky", max_retries=1)
        assert "HTTP 503" in env.reset([("e1", 0, {"q": "x"})])[0].error
        env.close()


def test_unreachable_server_and_refused_address():
    with env_server() as (base, _server):
        pass  # closed: nothing listens there any more
    env = _env(base, "good", max_retries=1, timeout_s=1)
    assert env.reset([("e1", 0, {"q": "x"})])[0].error is not None
    env.close()
    with pytest.raises(EgressRefused, match="non-public address"):
        make_environment(HttpEnvironment(url="http://127.0.0.1:9/env"), egress=EgressPolicy())
    with pytest.raises(ValueError, match="secret 'missing'"):
        make_environment(HttpEnvironment(url="http://127.0.0.1:9/env", auth_secret="missing"), egress=LOOPBACK)
