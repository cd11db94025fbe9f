"""Reward tests and grader runs: bounded wall time, per-project and global caps, no thread held."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx

from tests.service.api.conftest import LiveServer, assert_error, running_api
from tests.loopback_http import QuietHandler, base_url, serving


@contextmanager
def held_reward_server():
    """A remote reward that answers only once `release` is set (at most 30 s): (url, arrived, release)."""
    arrived, release = threading.Semaphore(0), threading.Event()

    class Handler(QuietHandler):
        def do_POST(self):
            samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
            arrived.release()
            release.wait(timeout=30)
            body = json.dumps({"scores": [1.0] * len(samples)}).encode()
            self.answer(200, body)

    with serving(Handler) as server:
        try:
            yield f"{base_url(server)}/score", arrived, release
        finally:
            release.set()  # before the server closes: it waits for the handler threads


def _test_body(url: str) -> dict:
    return {"spec": {"type": "http", "url": url, "retries": 0}, "completions": ["a"]}


def test_a_reward_test_past_its_wall_time_is_stopped_with_a_clear_error(database_url, tmp_path):
    with held_reward_server() as (url, _, _), \
            running_api(database_url, tmp_path, egress_allow="127.0.0.1", scoring_timeout_s=1.0) as api:
        t = time.monotonic()
        r = api.client.post("/v1/reward_functions/test", json=_test_body(url))
        assert_error(r, 502, "more than 1 s")
        assert r.json()["error"]["code"] == "reward_test_timeout"
        assert time.monotonic() - t < 25  # not the reward server's 30 s


def test_scoring_is_capped_per_project_and_in_all_and_holds_no_api_thread(database_url, tmp_path):
    settings = dict(egress_allow="127.0.0.1", scoring_per_project=1, scoring_total=2, api_threads=2,
                    scoring_timeout_s=60)
    with held_reward_server() as (url, arrived, release), running_api(database_url, tmp_path, **settings) as api, \
            LiveServer(api.app) as base:
        alpha = httpx.Client(base_url=base, headers={"Authorization": api.client.headers["authorization"]}, timeout=60)
        beta = httpx.Client(base_url=base, headers={"Authorization": api.other.headers["authorization"]}, timeout=60)
        answers: dict[str, int] = {}

        def run(name: str, client: httpx.Client) -> None:
            answers[name] = client.post("/v1/reward_functions/test", json=_test_body(url)).status_code

        threads = [threading.Thread(target=run, args=(name, client)) for name, client in (("alpha", alpha),
                                                                                           ("beta", beta))]
        for thread in threads:
            thread.start()
        for _ in threads:  # both scorings are in flight, waiting on the remote reward
            assert arrived.acquire(timeout=30)

        again = alpha.post("/v1/reward_functions/test", json=_test_body(url))
        assert_error(again, 429, "this project already runs 1")
        assert int(again.headers["retry-after"]) >= 1
        # Two scorings in flight and only two API threads: other routes still answer at once.
        assert alpha.get("/v1/files").status_code == 200
        assert beta.get("/v1/secrets").status_code == 200
        assert not answers  # the scorings were still running while those answered

        release.set()
        for thread in threads:
            thread.join(timeout=60)
        assert answers == {"alpha": 200, "beta": 200}
        assert alpha.post("/v1/reward_functions/test", json=_test_body(url)).status_code == 200  # slot freed
        alpha.close()
        beta.close()


def test_the_global_cap_refuses_a_third_project(database_url, tmp_path):
    with held_reward_server() as (url, arrived, release), \
            running_api(database_url, tmp_path, egress_allow="127.0.0.1", scoring_per_project=1,
                        scoring_total=1) as api, LiveServer(api.app) as base:
        alpha = httpx.Client(base_url=base, headers={"Authorization": api.client.headers["authorization"]}, timeout=60)
        beta = httpx.Client(base_url=base, headers={"Authorization": api.other.headers["authorization"]}, timeout=60)
        thread = threading.Thread(target=lambda: alpha.post("/v1/reward_functions/test", json=_test_body(url)))
        thread.start()
        assert arrived.acquire(timeout=30)
        assert_error(beta.post("/v1/fine_tuning/alpha/graders/run", json={
            "grader": {"type": "string_check", "name": "s", "input": "{{sample.output_text}}", "reference": "a",
                       "operation": "eq"}, "model_sample": "a"}), 429, "the service runs its limit of 1")
        release.set()
        thread.join(timeout=60)
        alpha.close()
        beta.close()
