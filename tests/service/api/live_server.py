"""A real uvicorn API process over a fresh PostgreSQL database, Redis and a local object store, with one
project's key: for tests whose client is another process (a browser, the `cispo jobs` CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.db.session import session_factory
from service.repositories import projects
from service.storage import open_store
from worker.toy.demo import wait_healthy
from tests.conftest import REDIS_TEST_URL, free_port, make_database
from tests.processes import stop


@dataclass
class LiveApi:
    base: str
    key: str
    database_url: str
    store: object
    env: dict
    log: Path

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key or self.key}"}, timeout=30)


@contextmanager
def live_api(root: Path, app: str = "service.api.app:create_app", **env):
    database_url, drop = make_database("postgresql", root)
    storage = root / "objects"
    env = {**os.environ, "DATABASE_URL": database_url, "BROKER_URL": REDIS_TEST_URL, "STORAGE_URL": str(storage),
           "CISPO_HOME": str(root / "home"), "PYTHONUNBUFFERED": "1", **env}
    with session_factory(database_url)() as s:
        key = projects.create_key(s, projects.get_or_create_project(s, "alpha"))
        s.commit()
    port = free_port()
    log = root / "api.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--factory", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        yield LiveApi(base, key, database_url, open_store(str(storage)), env, log)
    finally:
        stop(proc, 15)
        session_factory(database_url).kw["bind"].dispose()
        drop()
