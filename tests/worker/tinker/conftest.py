"""The Tinker API served for real: the API under uvicorn and the Tinker worker in a thread, over one database and
object store, for the real SDK to drive."""

from __future__ import annotations

import threading

import pytest

from tests.service.api.conftest import LiveServer, running_api
from worker.tinker.runner import TinkerRunner

tinker = pytest.importorskip("tinker")


class Served:
    """The API under uvicorn and a runner in a thread over one database and object store."""

    def __init__(self, api, base: str):
        self.api, self.base = api, base
        self.runner = TinkerRunner(api.app.state.settings, worker_id="test-runner")
        self.thread = threading.Thread(target=self.runner.run, daemon=True)
        self.live = LiveServer(api.app)
        self.clients: list = []  # closed while the server still answers: an open one's heartbeats outlive the test

    def __enter__(self) -> Served:
        self.url = self.live.__enter__()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for client in self.clients:
            client.close("success").result(timeout=30)
        self.runner.stop.set()
        self.thread.join(timeout=30)
        self.live.__exit__(*exc)

    def client(self, other: bool = False):
        key = (self.api.other if other else self.api.client).headers["Authorization"].removeprefix("Bearer ")
        self.clients.append(tinker.ServiceClient(base_url=self.url, api_key=f"tml-{key}"))
        return self.clients[-1]


@pytest.fixture
def served(database_url, tmp_path, toy_dir, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    base = str(toy_dir / "model")
    with running_api(database_url, tmp_path, tinker_base_models=base, tinker_poll_hold_s=1) as api, \
            Served(api, base) as s:
        yield s
