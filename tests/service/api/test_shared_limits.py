"""Limits with a Redis broker: two real API processes on one PostgreSQL and one Redis share the per-key
rate and the scoring caps; a killed replica's scoring slot frees when its lease lapses; a hung Redis
costs a short timeout and leaves each replica its own limits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from service.api.redis_limits import LEASE_MARGIN_S
from service.db.session import session_factory
from service.repositories import projects
from tests.service.api.conftest import assert_error, running_api
from tests.service.api.test_scoring_limits import _test_body, held_reward_server
from tests.conftest import REDIS_TEST_URL, free_port, make_database
from tests.tcp_proxy import TcpProxy
from worker.toy.demo import wait_healthy


@dataclass
class Replica:
    base: str
    proc: subprocess.Popen

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@contextmanager
def two_replicas(root: Path, **env):
    """Two uvicorn API processes on one fresh PostgreSQL database and the tests' Redis; yields
    (replicas, {project name: key}) for projects alpha, beta and gamma."""
    redis.Redis.from_url(REDIS_TEST_URL).flushdb()  # leases and buckets left by an earlier run
    database_url, drop = make_database("postgresql", root)
    with session_factory(database_url)() as s:
        keys = {name: projects.create_key(s, projects.get_or_create_project(s, name))
                for name in ("alpha", "beta", "gamma")}
        s.commit()
    env = {**os.environ, "DATABASE_URL": database_url, "BROKER_URL": REDIS_TEST_URL,
           "STORAGE_URL": str(root / "objects"), "CISPO_HOME": str(root / "home"), "CISPO_MODEL_HUB_URL": "",
           **{f"CISPO_{k.upper()}": str(v) for k, v in env.items()}}
    replicas = []
    try:
        for i in range(2):
            port = free_port()
            with (root / f"api{i}.log").open("w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory",
                                         "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
            replicas.append(Replica(f"http://127.0.0.1:{port}", proc))
            wait_healthy(replicas[-1].base, proc, root / f"api{i}.log")
        yield replicas, keys
    finally:
        for replica in replicas:
            replica.proc.kill()
            replica.proc.wait(15)
        session_factory(database_url).kw["bind"].dispose()
        drop()


def test_one_keys_rate_holds_across_two_replicas(tmp_path):
    with two_replicas(tmp_path, rate_limit_per_s=0.01, rate_limit_burst=10) as ((a, b), keys), \
            a.client(keys["alpha"]) as on_a, b.client(keys["alpha"]) as on_b, b.client(keys["beta"]) as beta:
        statuses = [(on_a if i % 2 else on_b).get("/v1/files") for i in range(30)]
        accepted = [r for r in statuses if r.status_code == 200]
        refused = [r for r in statuses if r.status_code == 429]
        # Per process this would have let 2 x 10 through; shared, the burst is the whole allowance
        # (the refill of 0.01/s adds nothing within the test).
        assert len(accepted) == 10 and len(refused) == 20
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert_error(refused[-1], 429, "rate limit")
        assert beta.get("/v1/files").status_code == 200  # still per key


def test_scoring_caps_hold_across_replicas_and_a_killed_replicas_slot_lapses(tmp_path):
    timeout_s = 10.0
    settings = dict(egress_allow="127.0.0.1", scoring_per_project=1, scoring_total=2, scoring_timeout_s=timeout_s)
    with held_reward_server() as (url, arrived, release), two_replicas(tmp_path, **settings) as ((a, b), keys), \
            ExitStack() as clients:
        alpha_a, alpha_b, beta_b, gamma_a = (clients.enter_context(r.client(keys[name])) for r, name in
                                             ((a, "alpha"), (b, "alpha"), (b, "beta"), (a, "gamma")))
        answers: dict[str, int] = {}

        def score(name: str, client: httpx.Client) -> threading.Thread:
            def run() -> None:
                try:
                    answers[name] = client.post("/v1/reward_functions/test", json=_test_body(url)).status_code
                except httpx.HTTPError:
                    answers[name] = -1  # its replica was killed under it

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        score("alpha", alpha_a)
        assert arrived.acquire(timeout=30)  # alpha scores on replica A ...
        assert_error(alpha_b.post("/v1/reward_functions/test", json=_test_body(url)), 429,
                     "this project already runs 1")  # ... so replica B refuses alpha's second
        beta = score("beta", beta_b)
        assert arrived.acquire(timeout=30)  # beta on B: two in all, the global cap
        third = gamma_a.post("/v1/reward_functions/test", json=_test_body(url))
        assert_error(third, 429, "the service runs its limit of 2")
        assert int(third.headers["retry-after"]) >= 1

        a.proc.kill()  # dies holding alpha's slot: nobody releases it
        a.proc.wait(15)
        killed_at = time.monotonic()
        release.set()
        beta.join(timeout=60)
        assert answers["beta"] == 200  # B released its own slot at once
        assert alpha_b.post("/v1/reward_functions/test", json=_test_body(url)).status_code == 429
        lapsed = None
        while time.monotonic() - killed_at < timeout_s + LEASE_MARGIN_S + 10:
            r = alpha_b.post("/v1/reward_functions/test", json=_test_body(url))
            if r.status_code == 200:
                lapsed = time.monotonic() - killed_at
                break
            assert r.status_code == 429, r.text
            time.sleep(0.5)
        assert lapsed is not None, "the dead replica's slot never freed"
        assert lapsed > 2  # it was the lease running out, not an early release


def test_a_hung_redis_costs_a_short_timeout_and_each_replica_keeps_its_own_limit(database_url, tmp_path):
    host, port = REDIS_TEST_URL.removeprefix("redis://").split("/")[0].split(":")
    with TcpProxy(host, int(port)) as proxy:
        proxy.stall()  # connections open, nothing answers: the worst kind of outage
        broker = f"redis://127.0.0.1:{proxy.port}/{REDIS_TEST_URL.rsplit('/', 1)[1]}"
        with running_api(database_url, tmp_path, BROKER_URL=broker, rate_limit_per_s=0.01,
                         rate_limit_burst=3) as api:
            started = time.monotonic()
            statuses = [api.client.get("/v1/files").status_code for _ in range(5)]
            assert statuses == [200, 200, 200, 429, 429]  # the in-process limit, neither open nor closed
            assert time.monotonic() - started < 5  # one 0.25 s timeout, then Redis is left alone a while
        proxy.unstall()


def test_stacks_sharing_one_redis_database_keep_their_own_limits(tmp_path):
    """The limit keys are per deployment (its database): two stacks on one Redis database do not share a budget,
    two replicas of one stack do."""
    import asyncio

    from service.api.ratelimit import rate_limit
    from service.errors import TooManyRequests
    from service.settings import Settings

    redis.Redis.from_url(REDIS_TEST_URL).flushdb()

    def limiter(db: str):
        return rate_limit(Settings(database_url=f"sqlite:///{tmp_path / db}", broker_url=REDIS_TEST_URL,
                                   rate_limit_per_s=0.001, rate_limit_burst=2))

    async def accepted(limit, n: int) -> int:
        ok = 0
        for _ in range(n):
            try:
                await limit.take("same-key")
                ok += 1
            except TooManyRequests:
                pass
        return ok

    async def scenario():
        a, a_replica, b = limiter("a.db"), limiter("a.db"), limiter("b.db")
        return await accepted(a, 2), await accepted(a_replica, 2), await accepted(b, 3)

    assert asyncio.run(scenario()) == (2, 0, 2)
