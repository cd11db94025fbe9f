"""Registering, reading and deleting reward functions."""

from __future__ import annotations

from sqlalchemy import func, select

from service.db.models import RewardFunction
from tests.service.api.conftest import assert_error, cispo_body, uploaded

SOURCE = "def reward(completion, **row):\n    return float(completion.strip() == row['answer'])\n"


def _count(api) -> int:
    with api.session() as s:
        return s.scalar(select(func.count()).select_from(RewardFunction))


def test_create_get_list_delete_python_reward(api):
    r = api.client.post("/v1/reward_functions", json={"name": "exact", "spec": {"type": "python", "source": SOURCE}})
    assert r.status_code == 200, r.text
    fn = r.json()
    assert fn["id"].startswith("rwfn-") and fn["object"] == "reward_function" and fn["type"] == "python"
    assert fn["spec"] == {"type": "python", "source": SOURCE, "entry_point": "reward"}  # the owner sees the source
    assert api.client.get(f"/v1/reward_functions/{fn['id']}").json() == fn
    api.client.post("/v1/reward_functions", json={"name": "c", "spec": {"type": "contains", "field": "answer"}})
    listed = api.client.get("/v1/reward_functions").json()
    assert [f["name"] for f in listed["data"]] == ["c", "exact"] and listed["has_more"] is False
    assert api.client.delete(f"/v1/reward_functions/{fn['id']}").json() == \
        {"id": fn["id"], "object": "reward_function", "deleted": True}
    assert_error(api.client.get(f"/v1/reward_functions/{fn['id']}"), 404, fn["id"])


def test_python_source_that_does_not_compile_names_the_line(api):
    bad = "def reward(completion, **row):\n    return (\n\ndef other(:\n"
    r = api.client.post("/v1/reward_functions", json={"name": "bad", "spec": {"type": "python", "source": bad}})
    error = assert_error(r, 400, "spec.source", "line")
    assert error["param"] == "spec.source"
    assert _count(api) == 0


def test_python_source_must_define_the_entry_point(api):
    r = api.client.post("/v1/reward_functions",
                        json={"name": "x", "spec": {"type": "python", "source": "def grade(s, i):\n    return 1\n"}})
    assert_error(r, 400, "spec", "'reward' is not defined")


def test_import_type_is_refused_and_unknown_fields_are_named(api):
    r = api.client.post("/v1/reward_functions", json={"name": "x", "spec": {"type": "import", "path": "os:system"}})
    assert_error(r, 400, "spec", "import", "local CLI")
    r = api.client.post("/v1/reward_functions",
                        json={"name": "x", "spec": {"type": "contains", "field": "a", "case_sensitiv": True}})
    assert_error(r, 400, "spec.case_sensitiv", "unknown field")
    r = api.client.post("/v1/reward_functions", json={"name": "x", "colour": "red",
                                                      "spec": {"type": "contains"}})
    assert_error(r, 400, "colour", "unknown field")
    r = api.client.post("/v1/reward_functions", json={"name": "x", "spec": {"type": "regex", "pattern": "(("}})
    assert_error(r, 400, "spec.pattern", "invalid regular expression")
    assert _count(api) == 0


def test_delete_is_refused_while_a_live_job_references_it(api):
    fn = api.client.post("/v1/reward_functions", json={"name": "c", "spec": {"type": "contains"}}).json()
    body = cispo_body(uploaded(api.client))
    body["method"]["cispo"] = {"reward_function": fn["id"]}
    job = api.client.post("/v1/fine_tuning/jobs", json=body).json()
    assert job["reward_function"] == fn["id"]
    r = api.client.delete(f"/v1/reward_functions/{fn['id']}")
    assert assert_error(r, 409, fn["id"], job["id"])["code"] == "reward_function_in_use"
    assert r.headers["x-should-retry"] == "false"
    api.client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
    assert api.client.delete(f"/v1/reward_functions/{fn['id']}").status_code == 200
