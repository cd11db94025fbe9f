"""Fixtures for API tests: the real app over a real database (SQLite and PostgreSQL), a local
object store in tmp_path, and an `enqueue` that records what it was sent instead of using a broker."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.db.session import session_factory
from service.repositories import jobs as jobs_repo
from service.repositories import projects
from service.settings import Settings
from tests.conftest import free_port, model_dirs_for_tests

TRAIN_ROWS = [{"prompt": f"Say {w}", "answer": w} for w in ("alpha", "beta", "gamma", "delta", "epsilon")]


@dataclass
class RecordingEnqueue:
    """Records job ids, and whether each job was already committed when its id was sent."""

    database_url: str
    ids: list[str] = field(default_factory=list)
    visible_at_send: list[bool] = field(default_factory=list)

    def __call__(self, job_id: str) -> None:
        with session_factory(self.database_url)() as fresh:
            self.visible_at_send.append(jobs_repo.get_for_worker(fresh, job_id) is not None)
        self.ids.append(job_id)


@dataclass
class Api:
    app: object
    client: TestClient  # project "alpha"
    other: TestClient  # project "beta": must never see alpha's resources
    anonymous: TestClient
    enqueued: RecordingEnqueue
    database_url: str
    store: object

    def session(self):
        return session_factory(self.database_url)()


def make_settings(database_url: str, tmp_path, **extra) -> Settings:
    extra.setdefault("model_hub_url", "")  # tests never reach a model hub
    extra.setdefault("model_dirs", model_dirs_for_tests(tmp_path.parent))  # tmp_path's parent: the basetemp
    return Settings(DATABASE_URL=database_url, STORAGE_URL=str(tmp_path / "objects"), home=tmp_path / "home",
                    **extra)


def _key(database_url: str, name: str) -> str:
    with session_factory(database_url)() as s:
        key = projects.create_key(s, projects.get_or_create_project(s, name))
        s.commit()
    return key


@contextmanager
def running_api(database_url: str, tmp_path, **settings) -> Iterator[Api]:
    """The app with two projects' clients; `settings` are extra Settings fields (e.g. egress_allow)."""
    recorder = RecordingEnqueue(database_url)
    app = create_app(make_settings(database_url, tmp_path, **settings), enqueue=recorder)

    def client(key: str | None) -> TestClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return TestClient(app, headers=headers, raise_server_exceptions=False)

    with client(_key(database_url, "alpha")) as a, client(_key(database_url, "beta")) as b, client(None) as anon:
        yield Api(app=app, client=a, other=b, anonymous=anon, enqueued=recorder, database_url=database_url,
                  store=app.state.store)


@pytest.fixture
def api(database_url, tmp_path) -> Api:
    with running_api(database_url, tmp_path) as built:
        yield built


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client: TestClient, rows=TRAIN_ROWS, *, name: str = "train.jsonl", content: bytes | None = None):
    data = jsonl(rows) if content is None else content
    return client.post("/v1/files", files={"file": (name, data, "application/jsonl")},
                       data={"purpose": "fine-tune"})


def uploaded(client: TestClient, rows=TRAIN_ROWS) -> str:
    r = upload(client, rows)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def cispo_body(training_file: str, **overrides) -> dict:
    body = {
        "model": "tiny-model",
        "training_file": training_file,
        "seed": 7,
        "method": {"type": "cispo", "cispo": {
            "reward": {"type": "exact_match", "field": "answer"},
            "hyperparameters": {"training": {"steps": 3, "batch_size": 2, "group_size": 4}},
        }},
    }
    body.update(overrides)
    return body


def created_job(api: Api, **overrides) -> dict:
    r = api.client.post("/v1/fine_tuning/jobs", json=cispo_body(uploaded(api.client), **overrides))
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(response, status: int, *needles: str) -> dict:
    """A 4xx in OpenAI's envelope whose message mentions each needle."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    assert "Traceback" not in response.text
    return error


class LiveServer:
    """The app under uvicorn on a free port, in a thread: real HTTP and the real threadpool."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
