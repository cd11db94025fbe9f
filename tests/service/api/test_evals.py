"""Eval runs through the API: which base models a run may name, the per-project cap on queued and running
runs, and cancel (the worker's side: tests/worker/jobs/test_eval_lease.py)."""

from __future__ import annotations

import pytest

from tests.service.api.conftest import assert_error, created_job, running_api, uploaded

EVALS = "/v1/evals"
REWARD = {"type": "exact_match", "field": "answer"}


@pytest.fixture
def api(database_url, tmp_path):
    with running_api(database_url, tmp_path, max_active_evals=2, serve_base_models="org/listed") as built:
        yield built


def _eval(api, model: str, client=None):
    client = client or api.client
    return client.post(EVALS, json={"model": model, "file": uploaded(client), "reward": REWARD, "max_rows": 2})


def test_a_base_model_must_be_one_the_project_may_run_as_it_is(api):
    for model in ("gpt2", "Qwen/Qwen2.5-0.5B", "models/tiny"):  # the worker would try to download these
        error = assert_error(_eval(api, model), 400, f"'{model}' is not a base model this project may use",
                             "CISPO_SERVE_BASE_MODELS")
        assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert assert_error(_eval(api, "/etc"), 400, "CISPO_MODEL_DIRS")["param"] == "model"  # not an allowed directory
    assert _eval(api, "org/listed").status_code == 200  # the operator lists it
    created_job(api)  # the project trains tiny-model: it may score where it started
    assert _eval(api, "tiny-model").status_code == 200
    assert _eval(api, "tiny-model", api.other).status_code == 400  # another project did not train on it


def test_a_project_has_at_most_its_cap_of_queued_and_running_runs(api):
    first, second = (_eval(api, "org/listed").json() for _ in range(2))
    error = assert_error(_eval(api, "org/listed"), 429, "2 queued or running eval runs",
                         "CISPO_MAX_ACTIVE_EVALS=2", "cancel one")
    assert error["code"] == "active_eval_quota_exceeded"
    assert _eval(api, "org/listed", api.other).status_code == 200  # the cap is per project
    assert api.client.post(f"{EVALS}/{first['id']}/cancel").status_code == 200
    assert _eval(api, "org/listed").status_code == 200  # a cancelled run frees its place
    assert second["status"] == "queued"


def test_cancel_ends_a_queued_run_and_an_ended_run_is_a_409(api):
    run = _eval(api, "org/listed").json()
    r = api.client.post(f"{EVALS}/{run['id']}/cancel")
    assert r.status_code == 200, r.text
    cancelled = r.json()
    assert (cancelled["object"], cancelled["id"], cancelled["status"]) == ("eval.run", run["id"], "cancelled")
    assert cancelled["finished_at"] is not None and cancelled["result"] is None
    assert api.client.get(f"{EVALS}/{run['id']}").json()["status"] == "cancelled"
    error = assert_error(api.client.post(f"{EVALS}/{run['id']}/cancel"), 409, "is cancelled")
    assert error["code"] == "invalid_eval_state"
    assert_error(api.other.post(f"{EVALS}/{run['id']}/cancel"), 404, "no such eval run")  # another project's
    assert_error(api.client.post(f"{EVALS}/evalrun_none/cancel"), 404, "no such eval run")
