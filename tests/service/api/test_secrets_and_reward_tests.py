"""Secrets (never returned, tenant-scoped), and dry-running rewards through the sandboxed runner subprocess."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.service.api.conftest import assert_error, running_api
from tests.worker.rewards.reward_servers import reward_server

SECRET = "Bearer sk-test-6f1c0e9a-do-not-leak"
FLAKY_SOURCE = '''
def reward(completion, **row):
    if completion == "boom":
        return 1 / 0
    if completion == "text":
        return "high"
    if completion == "nan":
        return float("nan")
    return len(completion) / 10
'''


class Responses:
    """Wraps a TestClient and keeps every response body, to grep them for the secret afterwards."""

    def __init__(self, client):
        self.client, self.bodies = client, []

    def __getattr__(self, method):
        def call(*args, **kwargs):
            response = getattr(self.client, method)(*args, **kwargs)
            self.bodies.append(response.text + str(response.headers))
            return response
        return call

    def leaked(self, value: str) -> bool:
        return any(value in body for body in self.bodies)


@pytest.fixture
def loopback_api(database_url, tmp_path):
    with running_api(database_url, tmp_path, egress_allow="127.0.0.1") as built:
        yield built


def test_secrets_are_created_listed_and_deleted_without_their_value(api):
    c = Responses(api.client)
    r = c.post("/v1/secrets", json={"name": "grader-key", "value": SECRET, "hosts": ["grader.example.com"]})
    assert r.status_code == 200, r.text
    created = r.json()
    assert set(created) == {"id", "object", "name", "hosts", "created_at"} and created["object"] == "secret"
    assert created["hosts"] == ["grader.example.com"]
    assert created["id"].startswith("secret-") and created["name"] == "grader-key"
    assert_error(c.post("/v1/secrets", json={"name": "grader-key", "value": "other", "hosts": ["h"]}), 409,
                 "already exists")
    assert_error(c.post("/v1/secrets", json={"name": "bad name!", "value": "x", "hosts": ["h"]}), 400, "name")
    assert_error(c.post("/v1/secrets", json={"name": "empty", "value": "", "hosts": ["h"]}), 400, "value")
    assert_error(c.post("/v1/secrets", json={"name": "unbound", "value": "x"}), 400, "hosts")
    assert_error(c.post("/v1/secrets", json={"name": "url", "value": "x", "hosts": ["https://h/x"]}), 400, "hosts")
    listed = c.get("/v1/secrets").json()
    assert [s["name"] for s in listed["data"]] == ["grader-key"] and "value" not in listed["data"][0]

    # another project sees nothing and cannot delete it
    other = Responses(api.other)
    assert other.get("/v1/secrets").json()["data"] == []
    assert_error(other.delete(f"/v1/secrets/{created['id']}"), 404, created["id"])
    assert other.post("/v1/secrets", json={"name": "grader-key", "value": "theirs",
                                                 "hosts": ["h"]}).status_code == 200  # own namespace

    assert c.delete(f"/v1/secrets/{created['id']}").json() == {"id": created["id"], "object": "secret", "deleted": True}
    assert c.get("/v1/secrets").json()["data"] == []
    assert not c.leaked(SECRET) and not other.leaked(SECRET)


def test_reward_test_endpoint_reports_scores_errors_by_kind_and_timing(api):
    fn = api.client.post("/v1/reward_functions", json={"name": "flaky", "spec": {"type": "python",
                                                                                   "source": FLAKY_SOURCE}}).json()
    r = api.client.post(f"/v1/reward_functions/{fn['id']}/test",
                        json={"completions": ["abcd", "boom", "text", "nan"]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "reward_function.test"
    assert out["scores"] == [0.4, None, None, None]
    assert [x["error_kind"] for x in out["results"]] == [None, "exception", "non_numeric", "non_finite"]
    assert out["results"][1]["error"] == "ZeroDivisionError: division by zero"
    assert out["errors"] == {"count": 3, "by_kind": {"exception": 1, "non_numeric": 1, "non_finite": 1}}
    assert out["timing"]["total_seconds"] > 0 and out["timing"]["per_sample_seconds"] > 0

    samples = api.client.post(f"/v1/reward_functions/{fn['id']}/test",
                              json={"samples": [{"completion": "ab", "row": {"x": 1}}]}).json()
    assert samples["scores"] == [0.2]
    assert_error(api.client.post(f"/v1/reward_functions/{fn['id']}/test", json={"completions": ["a"], "rows": []}),
                 400, "rows")
    assert_error(api.client.post(f"/v1/reward_functions/{fn['id']}/test", json={"completions": ["a"] * 33}),
                 400, "completions")
    assert_error(api.other.post(f"/v1/reward_functions/{fn['id']}/test", json={"completions": ["a"]}), 404)


def test_inline_reward_test_gives_sub_scores_and_names_load_errors(api):
    spec = {"type": "multi", "weights": {"exact": 1.0, "json": 0.5}, "rewards": {
        "exact": {"type": "exact_match", "strip_punctuation": True}, "json": {"type": "json_valid"}}}
    out = api.client.post("/v1/reward_functions/test", json={
        "spec": spec, "completions": ["Paris!", "[1]", "x"], "rows": [{"answer": "paris"}, {"answer": "1"}, {}]}).json()
    assert out["scores"] == [1.0, 1.5, None]
    assert out["sub_scores"] == {"exact": [1.0, 1.0, None], "json": [0.0, 1.0, 0.0]}
    assert out["results"][2]["error"].startswith("exact: KeyError") and out["errors"]["count"] == 1
    r = api.client.post("/v1/reward_functions/test", json={
        "spec": {"type": "python", "source": "import nonexistent_module_xyz\ndef reward(c, **r):\n    return 1\n"},
        "completions": ["a"]})
    assert_error(r, 400, "could not start", "nonexistent_module_xyz")


def test_http_reward_gets_the_secret_and_no_response_shows_it(loopback_api):
    c = Responses(loopback_api.client)
    with reward_server() as (base, rec):
        spec = {"type": "http", "url": f"{base}/good", "auth_secret": "grader-key", "retries": 0}
        assert_error(c.post("/v1/reward_functions", json={"name": "remote", "spec": spec}), 400, "grader-key",
                     "POST /v1/secrets")
        c.post("/v1/secrets", json={"name": "grader-key", "value": SECRET, "hosts": ["127.0.0.1"]})
        fn = c.post("/v1/reward_functions", json={"name": "remote", "spec": spec}).json()
        out = c.post(f"/v1/reward_functions/{fn['id']}/test", json={"completions": ["abc", "a"]}).json()
        assert out["scores"] == [0.3, 0.1]
        echo = c.post("/v1/reward_functions/test", json={"spec": {**spec, "url": f"{base}/echo-auth"},
                                                          "completions": ["a"]}).json()
        assert echo["results"][0]["error"] == "http: HTTP 500"
        c.get(f"/v1/reward_functions/{fn['id']}")
        c.get("/v1/reward_functions")
        c.get("/v1/secrets")
        body = {"model": "m", "training_file": "file-x", "method": {"type": "cispo", "cispo": {"reward": spec}}}
        c.post("/v1/fine_tuning/jobs", params={"dry_run": "true"}, json=body)
    assert {r["headers"]["Authorization"] for r in rec.requests} == {SECRET}
    assert len(c.bodies) >= 7 and not c.leaked(SECRET) and not c.leaked("sk-test-6f1c0e9a")


def test_user_code_is_refused_when_the_operator_turned_the_sandbox_off(database_url, tmp_path):
    with running_api(database_url, tmp_path, sandbox="off") as off:
        r = off.client.post("/v1/reward_functions/test", json={"completions": ["a"], "spec": {
            "type": "python", "source": "def reward(completion, **row):\n    return 1.0\n"}})
        assert_error(r, 400, "could not start", "sandbox is turned off")
        builtin = off.client.post("/v1/reward_functions/test", json={"completions": ["a"], "rows": [{"answer": "a"}],
                                                                     "spec": {"type": "exact_match"}})
        assert builtin.json()["scores"] == [1.0]  # our own code still runs


def test_remote_urls_are_egress_checked_when_registered(api):
    spec = {"type": "http", "url": "http://127.0.0.1:9/score"}
    error = assert_error(api.client.post("/v1/reward_functions", json={"name": "r", "spec": spec}), 400,
                         "non-public")
    assert error["code"] == "egress_refused" and error["param"] == "spec"


def test_the_api_process_scores_without_importing_the_worker_or_torch(tmp_path):
    script = textwrap.dedent(f'''
        import sys
        from fastapi.testclient import TestClient
        from service.api.app import create_app
        from service.db.migrate import upgrade
        from service.db.session import session_factory
        from service.repositories import projects
        from service.settings import Settings
        url = "sqlite:///{tmp_path}/db.sqlite"
        upgrade(url)
        with session_factory(url)() as s:
            key = projects.create_key(s, projects.get_or_create_project(s, "p"))
            s.commit()
        app = create_app(Settings(DATABASE_URL=url, STORAGE_URL="{tmp_path}/o", home="{tmp_path}/h"),
                         enqueue=lambda job_id: None)
        client = TestClient(app, headers={{"Authorization": "Bearer " + key}})
        r = client.post("/v1/reward_functions/test", json={{"completions": ["abc"], "spec": {{
            "type": "python", "source": "def reward(completion, **row):\\n    return len(completion)\\n"}}}})
        assert r.status_code == 200 and r.json()["scores"] == [3.0], r.text
        loaded = [m for m in sys.modules if m == "torch" or m == "worker" or m.startswith("worker.")]
        assert not loaded, loaded
        print("clean")
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-2000:]
