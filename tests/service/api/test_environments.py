"""/v1/environments: register, read, delete (tenant-scoped), and jobs that run an environment."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.api.app import create_app
from service.db.models import Environment, Job
from service.job_spec.spec import JobSpec
from tests.service.api.conftest import RecordingEnqueue, _key, assert_error, cispo_body, make_settings, uploaded

ENVS = "/v1/environments"
JOBS = "/v1/fine_tuning/jobs"
SOURCE = '''
class Game:
    def reset(self, seed, row):
        return row["prompt"]

    def step(self, action):
        return None, float(action == "yes"), True, False, {}
'''
PYTHON_ENV = {"type": "python", "source": SOURCE, "class_name": "Game"}


def _count(api) -> int:
    with api.session() as s:
        return s.scalar(select(func.count()).select_from(Environment))


def _register(client, spec=PYTHON_ENV, name="game"):
    r = client.post(ENVS, json={"name": name, "spec": spec})
    assert r.status_code == 200, r.text
    return r.json()


def env_job_body(training_file: str, environment, **training) -> dict:
    body = cispo_body(training_file)
    body["method"]["cispo"] = {"environment": environment, "hyperparameters": {
        "training": {"steps": 3, "batch_size": 2, "group_size": 4, "max_turns": 3, **training},
        "advantages": {"per_turn": True}}}
    return body


def test_create_get_list_delete(api):
    env = _register(api.client)
    assert env["id"].startswith("env-") and env["object"] == "environment" and env["type"] == "python"
    assert env["spec"] == {**PYTHON_ENV, "timeout_s": 10.0, "memory_mb": 1024}  # the owner sees the source
    assert api.client.get(f"{ENVS}/{env['id']}").json() == env
    _register(api.client, name="second")
    listed = api.client.get(ENVS).json()
    assert [e["name"] for e in listed["data"]] == ["second", "game"] and listed["has_more"] is False
    assert api.client.get(ENVS, params={"limit": 1}).json()["has_more"] is True
    assert api.client.delete(f"{ENVS}/{env['id']}").json() == {"id": env["id"], "object": "environment",
                                                               "deleted": True}
    assert_error(api.client.get(f"{ENVS}/{env['id']}"), 404, env["id"])


@pytest.mark.parametrize("spec, status, param, needle", [
    ({**PYTHON_ENV, "source": "class Game(:\n"}, 400, "spec.source", "line 1"),
    ({**PYTHON_ENV, "class_name": "Other"}, 400, "spec", "class 'Other' is not defined"),
    ({**PYTHON_ENV, "source": "class Game:\n    def reset(self, seed, row):\n        return ''\n"}, 400, "spec",
     "must define step"),
    ({**PYTHON_ENV, "class_name": "not valid"}, 400, "spec.class_name", "not a Python identifier"),
    ({**PYTHON_ENV, "timeout_s": 0}, 400, "spec.timeout_s", "greater than 0"),
    ({**PYTHON_ENV, "colour": "red"}, 400, "spec.colour", "unknown field"),
    ({"type": "lua", "source": "x"}, 400, "spec", "'python', 'http'"),
    ({"type": "http", "url": "ftp://env.example.com"}, 400, "spec.url", "http(s) URL"),
    ({"type": "http", "url": "https://env.example.com/?token=1"}, 400, "spec.url", "query"),
    ({"type": "http", "url": "https://user:pw@env.example.com"}, 400, "spec.url", "credentials"),
    ({"type": "http", "url": "http://127.0.0.1:9/env"}, 400, "spec.url", "non-public address"),
    ({"type": "http", "url": "https://env.example.com", "auth_secret": "nope"}, 400, "spec.auth_secret",
     "secret 'nope'"),
])
def test_bad_specs_are_refused_naming_the_field(api, spec, status, param, needle):
    error = assert_error(api.client.post(ENVS, json={"name": "x", "spec": spec}), status, needle)
    assert error["param"] == param
    assert _count(api) == 0


def test_http_environment_on_an_allow_listed_host_with_a_secret(database_url, tmp_path):
    app = create_app(make_settings(database_url, tmp_path, egress_allow="127.0.0.1"),
                     enqueue=RecordingEnqueue(database_url))
    with TestClient(app, headers={"Authorization": f"Bearer {_key(database_url, 'gamma')}"}) as client:
        spec = {"type": "http", "url": "http://127.0.0.1:9/env/", "auth_secret": "env-key"}
        assert_error(client.post(ENVS, json={"name": "remote", "spec": spec}), 400, "env-key")
        assert client.post("/v1/secrets", json={"name": "env-key", "value": "Bearer x",
                                                      "hosts": ["127.0.0.1"]}).status_code == 200
        env = _register(client, spec, name="remote")
        assert env["spec"]["url"] == "http://127.0.0.1:9/env" and "Bearer x" not in str(env)


def test_jobs_run_a_registered_or_inline_environment(api):
    file_id = uploaded(api.client)
    env = _register(api.client)
    r = api.client.post(JOBS, json=env_job_body(file_id, env["id"]))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["environment"] == env["id"] and job["reward_function"] is None
    with api.session() as s:
        row = s.scalar(select(Job).where(Job.id == job["id"]))
        spec = JobSpec.model_validate(row.spec)  # exactly what the worker will run
        assert row.environment_id == env["id"]
    assert spec.reward is None and spec.environment.class_name == "Game"
    assert spec.training.max_turns == 3 and spec.advantages.per_turn

    inline = api.client.post(JOBS, json=env_job_body(file_id, PYTHON_ENV)).json()
    assert inline["environment"] is None
    with api.session() as s:
        assert s.scalar(select(Job).where(Job.id == inline["id"])).spec["environment"]["class_name"] == "Game"


def test_job_environment_errors_name_the_field(api):
    file_id = uploaded(api.client)
    body = env_job_body(file_id, "env-missing")
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.environment", "env-missing")
    body = env_job_body(file_id, {**PYTHON_ENV, "source": "class Game(:\n"})
    error = assert_error(api.client.post(JOBS, json=body), 400, "line 1")
    assert error["param"] == "method.cispo.environment.source"
    body = env_job_body(file_id, PYTHON_ENV)
    body["method"]["cispo"]["reward"] = {"type": "contains"}
    assert_error(api.client.post(JOBS, json=body), 400, "exactly one of", "environment")
    body = env_job_body(file_id, PYTHON_ENV, max_turns=65)
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.hyperparameters.training.max_turns")
    body = cispo_body(file_id)
    body["method"]["cispo"]["hyperparameters"]["training"]["max_turns"] = 2
    error = assert_error(api.client.post(JOBS, json=body), 400, "max_turns is 2", "environment")
    assert error["param"] == "method.cispo"
    body = env_job_body(file_id, {"type": "http", "url": "http://10.0.0.1/env"})
    error = assert_error(api.client.post(JOBS, json=body), 400, "non-public address")
    assert error["param"] == "method.cispo.environment.url"


def test_environments_are_tenant_scoped(api):
    env = _register(api.client)
    for method in ("get", "delete"):
        assert_error(getattr(api.other, method)(f"{ENVS}/{env['id']}"), 404, env["id"])
    assert api.other.get(ENVS).json()["data"] == []
    assert_error(api.other.get(ENVS, params={"after": env["id"]}), 400, "after")
    body = env_job_body(uploaded(api.other), env["id"])
    assert_error(api.other.post(JOBS, json=body), 400, "no such environment")
    assert api.client.get(f"{ENVS}/{env['id']}").status_code == 200


def test_delete_is_refused_while_a_live_job_uses_it(api):
    env = _register(api.client)
    job = api.client.post(JOBS, json=env_job_body(uploaded(api.client), env["id"])).json()
    r = api.client.delete(f"{ENVS}/{env['id']}")
    assert assert_error(r, 409, env["id"], job["id"])["code"] == "environment_in_use"
    assert r.headers["x-should-retry"] == "false"
    api.client.post(f"{JOBS}/{job['id']}/cancel")
    assert api.client.delete(f"{ENVS}/{env['id']}").status_code == 200
