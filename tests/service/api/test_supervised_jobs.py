"""POST /v1/fine_tuning/jobs with `method.type: supervised` (OpenAI's SFT shape): the spec it resolves and
the errors that name the request's fields."""

from __future__ import annotations

from service.repositories import jobs as jobs_repo
from tests.service.api.conftest import assert_error, uploaded

JOBS = "/v1/fine_tuning/jobs"
CHATS = [{"messages": [{"role": "user", "content": f"{w}="}, {"role": "assistant", "content": w[-1]}]}
         for w in ("ab", "cde", "fa", "bcd", "ea")]


def _body(file_id: str, **hyperparameters) -> dict:
    return {"model": "tiny-model", "training_file": file_id, "seed": 1,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}}


def test_openai_sft_hyperparameters_resolve_to_a_supervised_spec(api):
    file_id = uploaded(api.client, CHATS)
    r = api.client.post(JOBS, json=_body(file_id, batch_size=2, n_epochs=2, learning_rate_multiplier=10,
                                         lora=None))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["method"]["type"] == "supervised"
    with api.session() as s:
        spec = jobs_repo.get_for_worker(s, job["id"]).spec
    assert spec["method"] == "supervised" and spec["reward"] is None and spec["lora"] is None
    assert spec["training"]["steps"] == 5  # ceil(2 epochs * 5 rows / 2)
    assert spec["training"]["batch_size"] == 2 and spec["optimizer"]["lr"] == 1e-4
    # "auto": three epochs of batches of up to 8 rows
    r = api.client.post(JOBS, json=_body(file_id))
    with api.session() as s:
        spec = jobs_repo.get_for_worker(s, r.json()["id"]).spec
    assert (spec["training"]["batch_size"], spec["training"]["steps"]) == (5, 3)


def test_supervised_errors_name_the_request_field(api):
    file_id = uploaded(api.client, CHATS)
    assert_error(api.client.post(JOBS, json=_body(file_id, n_epochs=0)), 400,
                 "method.supervised.hyperparameters.n_epochs")
    assert_error(api.client.post(JOBS, json=_body(file_id, training={"eval_max_rows": 0})), 400,
                 "method.supervised.hyperparameters.training.eval_max_rows")
    body = _body(file_id)
    body["method"]["cispo"] = {"reward": {"type": "contains"}}
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo must be left out")
    body = _body(file_id)
    body["method"]["supervised"]["reward_function"] = "rwfn-nope"
    assert_error(api.client.post(JOBS, json=body), 400, "method.supervised.reward_function")


def test_a_supervised_dry_run_checks_and_creates_nothing(api):
    file_id = uploaded(api.client, CHATS)
    r = api.client.post(JOBS, params={"dry_run": "true"}, json=_body(file_id, n_epochs=1))
    assert r.status_code == 200, r.text
    assert r.json()["spec"]["method"] == "supervised"
    assert api.client.get(JOBS).json()["data"] == []
