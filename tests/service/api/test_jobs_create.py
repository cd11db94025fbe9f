"""Creating fine-tuning jobs: the resolved spec, enqueue-after-commit, dry runs, RFT mapping, idempotency."""

from __future__ import annotations

import math

from sqlalchemy import func, select

from service.db.models import Job, JobEvent
from service.job_spec.spec import JobSpec
from tests.service.api.conftest import TRAIN_ROWS, assert_error, cispo_body, running_api, uploaded

JOBS = "/v1/fine_tuning/jobs"


def _count(api, model=Job) -> int:
    with api.session() as s:
        return s.scalar(select(func.count()).select_from(model))


def test_create_stores_a_queued_job_and_enqueues_its_id_once_after_commit(api):
    file_id = uploaded(api.client)
    r = api.client.post(JOBS, json=cispo_body(file_id, suffix="v1", metadata={"team": "rl"}))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
    assert (job["status"], job["training_file"], job["model"], job["seed"]) == ("queued", file_id, "tiny-model", 7)
    assert (job["total_steps"], job["steps_done"], job["fine_tuned_model"], job["error"]) == (3, 0, None, None)
    assert job["metadata"] == {"team": "rl"} and job["user_provided_suffix"] == "v1"
    assert job["hyperparameters"] == {"batch_size": 2, "learning_rate_multiplier": 1.0,
                                      "n_epochs": 1}  # 3 steps of 2 rows over 5 rows: 1.2 passes
    assert job["method"]["type"] == "cispo" and job["reward_function"] is None
    assert (job["result_files"], job["integrations"], job["estimated_finish"]) == ([], [], None)
    assert api.enqueued.ids == [job["id"]]
    assert api.enqueued.visible_at_send == [True]  # the worker can already read the row
    with api.session() as s:
        row = s.scalar(select(Job).where(Job.id == job["id"]))
        spec = JobSpec.model_validate(row.spec)  # the stored spec is exactly one the worker accepts
        assert spec.data.train_file == file_id and spec.training.group_size == 4
        assert spec.reward.type == "exact_match"
        events = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job["id"])))
        assert events == ["Job created"]


def test_seed_is_generated_when_absent_and_returned(api):
    body = cispo_body(uploaded(api.client))
    del body["seed"]
    job = api.client.post(JOBS, json=body).json()
    assert 0 <= job["seed"] < 2**31
    with api.session() as s:
        assert s.scalar(select(Job.spec).where(Job.id == job["id"]))["seed"] == job["seed"]


def test_dry_run_returns_the_resolved_spec_and_creates_nothing(api):
    file_id = uploaded(api.client)
    body = cispo_body(file_id)
    body["method"]["cispo"]["hyperparameters"]["loss"] = {"ratio_max": 4.0}
    r = api.client.post(JOBS, params={"dry_run": "true"}, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "fine_tuning.job.dry_run"
    spec = JobSpec.model_validate(out["spec"])
    assert (spec.loss.ratio_max, spec.training.steps, spec.seed, spec.data.train_file) == (4.0, 3, 7, file_id)
    assert spec.optimizer.max_grad_norm == 1.0 and spec.lora.r == 16  # untouched sections keep their defaults
    assert _count(api) == 0 and _count(api, JobEvent) == 0 and api.enqueued.ids == []


def test_unset_optional_values_are_kept_as_sent(api):
    body = cispo_body(uploaded(api.client))
    body["method"]["cispo"]["hyperparameters"]["optimizer"] = {"max_grad_norm": None, "lr": 3e-5}
    spec = api.client.post(JOBS, params={"dry_run": "true"}, json=body).json()["spec"]
    assert spec["optimizer"]["max_grad_norm"] is None and spec["optimizer"]["lr"] == 3e-5


def test_rollout_engine_is_a_hyperparameter(api):
    """The rollout section reaches the spec as sent; a bad value is a 400 naming its field."""
    body = cispo_body(uploaded(api.client))
    body["method"]["cispo"]["hyperparameters"]["rollout"] = {"engine": "vllm", "tis_cap": None}
    spec = api.client.post(JOBS, params={"dry_run": "true"}, json=body).json()["spec"]
    assert spec["rollout"]["engine"] == "vllm" and spec["rollout"]["tis_cap"] is None
    body["method"]["cispo"]["hyperparameters"]["rollout"] = {"engine": "sglang"}
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.hyperparameters.rollout.engine")
    body["method"]["cispo"]["hyperparameters"]["rollout"] = {"dtype": "int8"}
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.hyperparameters.rollout.dtype")
    body["method"]["cispo"]["hyperparameters"]["rollout"] = {"max_staleness": 1, "version_policy": "oldest"}
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.hyperparameters.rollout.version_policy")
    assert _count(api) == 0
    body["method"]["cispo"]["hyperparameters"]["rollout"] = {"max_staleness": 1, "version_policy": "fixed_lag"}
    spec = api.client.post(JOBS, params={"dry_run": "true"}, json=body).json()["spec"]
    assert spec["rollout"]["version_policy"] == "fixed_lag"


def test_float16_training_is_refused_naming_the_field(api):
    """No loss scaling: float16 gradients underflow, so the job dtype cannot be float16 (sampling in it may)."""
    body = cispo_body(uploaded(api.client))
    body["method"]["cispo"]["hyperparameters"]["dtype"] = "float16"
    r = api.client.post(JOBS, json=body)
    assert_error(r, 400, "method.cispo.hyperparameters.dtype")
    assert "bfloat16" in r.text
    body["method"]["cispo"]["hyperparameters"].update(dtype="bfloat16", rollout={"dtype": "float16"})
    assert api.client.post(JOBS, params={"dry_run": "true"}, json=body).status_code == 200
    assert _count(api) == 0


def test_vllm_with_several_gpus_is_refused_naming_both_fields(api):
    """The in-process vLLM engine cannot serve an FSDP job: a 400 naming rollout.engine and resources.gpus."""
    body = cispo_body(uploaded(api.client))
    hp = body["method"]["cispo"]["hyperparameters"]
    hp["rollout"], hp["resources"] = {"engine": "vllm"}, {"gpus": 2}
    error = assert_error(api.client.post(JOBS, json=body), 400, "rollout.engine", "resources.gpus")
    assert error["type"] == "invalid_request_error"
    hp["resources"] = {"gpus": 1}
    assert api.client.post(JOBS, params={"dry_run": "true"}, json=body).status_code == 200
    hp["rollout"], hp["resources"] = {"engine": "hf"}, {"gpus": 2}
    assert api.client.post(JOBS, params={"dry_run": "true"}, json=body).status_code == 200
    assert _count(api) == 0


def test_reinforcement_string_check_maps_onto_cispo(api):
    file_id = uploaded(api.client)
    body = {"model": "tiny-model", "training_file": file_id, "seed": 1, "method": {
        "type": "reinforcement", "reinforcement": {
            "grader": {"type": "string_check", "name": "match", "input": "{{sample.output_text}}",
                       "reference": "{{ item.answer }}", "operation": "ilike"},
            "hyperparameters": {"batch_size": 2, "n_epochs": 3, "learning_rate_multiplier": 2.0,
                                "eval_interval": 5, "eval_samples": 9, "compute_multiplier": 0.5,
                                "reasoning_effort": "auto"},
            "response_format": None}}}
    r = api.client.post(JOBS, json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    with api.session() as s:
        spec = JobSpec.model_validate(s.scalar(select(Job.spec).where(Job.id == job["id"])))
    assert spec.reward.model_dump() == {"type": "string_check", "input": "{{sample.output_text}}",
                                        "reference": "{{ item.answer }}", "operation": "ilike"}
    assert spec.training.batch_size == 2
    assert spec.training.steps == math.ceil(3 * len(TRAIN_ROWS) / 2)
    assert math.isclose(spec.optimizer.lr, 2e-5)
    assert (spec.training.eval_interval, spec.training.eval_max_rows, spec.training.group_size) == (5, 9, 4)
    assert job["method"] == body["method"]  # echoed as sent
    assert job["hyperparameters"]["learning_rate_multiplier"] == 2.0


def test_string_check_operations(api):
    file_id = uploaded(api.client)

    def reward(operation: str):
        body = {"model": "m", "training_file": file_id, "method": {"type": "reinforcement", "reinforcement": {
            "grader": {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
                       "reference": "{{item.answer}}", "operation": operation}}}}
        return api.client.post(JOBS, params={"dry_run": "true"}, json=body)

    for operation in ("eq", "ne", "like", "ilike"):
        assert reward(operation).json()["spec"]["reward"] == {
            "type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
            "operation": operation}
    assert_error(reward("contains"), 400, "method.reinforcement.grader.operation")


def test_unsupported_graders_and_rft_options_are_refused_by_name(api):
    file_id = uploaded(api.client)

    def post(reinforcement: dict):
        body = {"model": "m", "training_file": file_id, "method": {"type": "reinforcement",
                                                                   "reinforcement": reinforcement}}
        return api.client.post(JOBS, json=body)

    grader = {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
              "reference": "{{item.answer}}", "operation": "eq"}
    error = assert_error(post({"grader": {"type": "label_model", "name": "p"}}), 400,
                         "method.reinforcement.grader.type", "label_model", "not supported")
    assert error["param"] == "method.reinforcement.grader.type"
    assert_error(post({"grader": {"type": "python", "name": "p", "source": "x"}}), 400,
                 "method.reinforcement.grader.source", "def grade")
    assert_error(post({"grader": {**grader, "reference": "{{row.a}}"}}), 400, "grader.reference", "row.a")
    assert_error(post({"grader": {**grader, "input": "{{sample.output_tools}}"}}), 400, "grader.input",
                 "sample.output_tools")
    error = assert_error(post({"grader": {**grader, "reference": "{{ item.answer"}}), 400, "grader.reference",
                         "no closing", "{{ item.answer")
    assert error["param"] == "method.reinforcement.grader.reference"
    assert_error(post({"grader": {**grader, "extra": 1}}), 400, "method.reinforcement.grader.extra", "unknown")
    assert_error(post({"grader": grader, "hyperparameters": {"reasoning_effort": "high"}}), 400,
                 "reasoning_effort", "not supported")
    assert_error(post({"grader": grader, "hyperparameters": {"batch_size": 0}}), 400,
                 "method.reinforcement.hyperparameters.batch_size")
    assert_error(post({"grader": grader, "response_format": {"type": "json_schema"}}), 400, "response_format")
    assert _count(api) == 0 and api.enqueued.ids == []


def test_idempotency_key_replays_the_same_job_and_refuses_a_different_body(api):
    body = cispo_body(uploaded(api.client))
    first = api.client.post(JOBS, json=body, headers={"Idempotency-Key": "k-1"})
    again = api.client.post(JOBS, json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert _count(api) == 1 and api.enqueued.ids == [first.json()["id"]]
    changed = api.client.post(JOBS, json={**body, "suffix": "other"}, headers={"Idempotency-Key": "k-1"})
    assert assert_error(changed, 400, "Idempotency-Key")["param"] == "Idempotency-Key"
    other = api.client.post(JOBS, json=body, headers={"Idempotency-Key": "k-2"})
    assert other.json()["id"] != first.json()["id"] and _count(api) == 2
    # The key is per project: another project may use the same one.
    other_file = uploaded(api.other)
    assert api.other.post(JOBS, json=cispo_body(other_file), headers={"Idempotency-Key": "k-1"}).status_code == 200


def test_referenced_files_and_reward_functions_must_exist_in_the_project(api):
    file_id = uploaded(api.client)
    error = assert_error(api.client.post(JOBS, json=cispo_body("file-missing")), 400, "training_file", "file-missing")
    assert error["param"] == "training_file"
    assert_error(api.client.post(JOBS, json=cispo_body(file_id, validation_file="file-missing")), 400,
                 "validation_file")
    body = cispo_body(file_id)
    body["method"]["cispo"] = {"reward_function": "rwfn-missing"}
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.reward_function", "rwfn-missing")
    assert _count(api) == 0 and api.enqueued.ids == []


def test_out_of_range_hyperparameters_name_the_field(api):
    body = cispo_body(uploaded(api.client))
    body["method"]["cispo"]["hyperparameters"]["training"]["group_size"] = 1
    error = assert_error(api.client.post(JOBS, json=body), 400,
                         "method.cispo.hyperparameters.training.group_size: Input should be greater than or equal to 2")
    assert error["param"] == "method.cispo.hyperparameters.training.group_size"
    body["method"]["cispo"]["hyperparameters"] = {"schedule": {"type": "cosine", "min_lr_ratio": 2}}
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.hyperparameters.schedule.min_lr_ratio")
    body["method"]["cispo"]["hyperparameters"] = {"sampling": {"max_output_tokens": 64, "max_model_len": 32}}
    assert_error(api.client.post(JOBS, json=body), 400, "method.cispo.hyperparameters.sampling", "max_model_len")
    assert _count(api) == 0


def test_bad_job_bodies_are_refused_naming_the_field(api):
    file_id = uploaded(api.client)
    cases = [
        ({"wat": 1}, "wat", "unknown field"),
        ({"seed": "seven"}, "seed", "integer"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"suffix": "x" * 65}, "suffix", "64"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "512"),
        ({"integrations": [{"type": "neptune", "neptune": {}}]}, "integrations[0].type", "'wandb' or 'mlflow'"),
        ({"integrations": [{"type": "wandb", "wandb": {"name": "run"}}]}, "integrations[0].wandb.project",
         "Field required"),
        ({"integrations": [{"type": "wandb"}]}, "integrations[0]", "its settings object 'wandb' is required"),
        ({"integrations": [{"type": "mlflow", "mlflow": {"tracking_uri": "ftp://h/x"}}]},
         "integrations[0].mlflow.tracking_uri", "http(s) URL or a file: URI"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p", "colour": "red"}}]},
         "integrations[0].wandb.colour", "unknown field"),
        ({"method": {"type": "cispo", "cispo": {"reward": {"type": "contains", "field": "answer"}, "hyperparameters": {
            "lora": None, "training": {"export": "merged"}}}}}, "method.cispo", "training.export 'merged'"),
        ({"method": {"type": "cispo", "cispo": {"reward": {"type": "contains", "field": "answer"}, "hyperparameters": {
            "training": {"export": "gguf"}}}}}, "method.cispo.hyperparameters.training.export", "'adapter' or 'merged'"),
        ({"hyperparameters": {"n_epochs": 3}}, "hyperparameters", "deprecated"),
        ({"model": ""}, "model", "at least 1"),
        ({"method": {"type": "dpo"}}, "method.type", "'cispo', 'reinforcement' or 'supervised'"),
        ({"method": {"type": "cispo"}}, "method", "method.cispo is required"),
        ({"method": {"type": "cispo", "cispo": {}}}, "method.cispo", "exactly one of"),
        ({"method": {"type": "cispo", "cispo": {"reward": {"type": "import", "path": "os:system"}}}},
         "method.cispo.reward", "local CLI"),
        ({"method": {"type": "cispo", "cispo": {"reward": {"type": "python", "source": "def reward(:"}}}},
         "method.cispo.reward.source", "line 1"),
        ({"method": {"type": "cispo", "cispo": {"reward": {"type": "contains"}, "hyperparameters": {
            "training": {"steps": 2, "bogus": 1}}}}}, "method.cispo.hyperparameters.training.bogus", "unknown field"),
    ]
    for override, field, words in cases:
        r = api.client.post(JOBS, json=cispo_body(file_id, **override))
        assert_error(r, 400, field, words)
    body = cispo_body(file_id)
    del body["model"]
    assert_error(api.client.post(JOBS, json=body), 400, "model: Field required")
    assert _count(api) == 0 and api.enqueued.ids == []


def test_integrations_are_kept_on_the_job_and_a_tracking_uri_must_be_allowed(database_url, tmp_path):
    allowed = tmp_path / "mlruns"
    with running_api(database_url, tmp_path, tracking_file_roots=str(allowed), wandb_entities="e") as api:
        file_id = uploaded(api.client)
        wandb = {"type": "wandb", "wandb": {"project": "p", "name": "n", "entity": "e", "tags": ["t"]}}
        mlflow = {"type": "mlflow", "mlflow": {"tracking_uri": f"file:{allowed}/store", "experiment": "x"}}
        r = api.client.post(JOBS, json=cispo_body(file_id, integrations=[wandb, mlflow]))
        assert r.status_code == 200, r.text
        assert [i["type"] for i in r.json()["integrations"]] == ["wandb", "mlflow"]
        assert r.json()["integrations"][0]["wandb"]["project"] == "p"
        # The worker would write where the URI points: outside the operator's roots, or a private host, is refused.
        for uri, words in ((f"file:{tmp_path}/elsewhere", "lie under a directory"),
                           ("file://otherhost/x", "not a host"),
                           ("http://127.0.0.1:5000", "non-public address")):
            body = cispo_body(file_id, integrations=[{"type": "mlflow", "mlflow": {"tracking_uri": uri}}])
            assert_error(api.client.post(JOBS, json=body), 400, "integrations[0].mlflow.tracking_uri", words)
        assert _count(api) == 1


def test_a_failing_broker_still_returns_the_committed_job(api):
    def broken(job_id):
        raise ConnectionError("broker down")

    api.app.state.enqueue = broken
    r = api.client.post(JOBS, json=cispo_body(uploaded(api.client)))
    assert r.status_code == 200 and r.json()["status"] == "queued"
    assert _count(api) == 1  # the reconciler re-enqueues it from SQL


def test_a_concurrent_duplicate_that_loses_the_insert_returns_the_winner(api, monkeypatch):
    """Two requests with one key: both miss the lookup, the second's insert hits the unique key."""
    from service import jobs as jobs_service

    body = cispo_body(uploaded(api.client))
    winner = api.client.post(JOBS, json=body, headers={"Idempotency-Key": "race"}).json()
    real_replay, calls = jobs_service.replay, []

    def replay_that_misses_once(*args):
        calls.append(args)
        return None if len(calls) == 1 else real_replay(*args)  # the first lookup ran before the winner committed

    monkeypatch.setattr(jobs_service, "replay", replay_that_misses_once)
    loser = api.client.post(JOBS, json=body, headers={"Idempotency-Key": "race"})
    assert loser.status_code == 200 and loser.json()["id"] == winner["id"]
    assert len(calls) == 2 and _count(api) == 1 and api.enqueued.ids == [winner["id"]]


def test_openapi_documents_the_cispo_reward_function(api):
    schemas = api.client.get("/openapi.json").json()["components"]["schemas"]
    described = schemas["CispoMethod"]["properties"]["reward_function"]["description"]
    assert "/v1/reward_functions" in described and "reward(completion, **row)" in described


def test_create_refuses_rows_of_either_file_that_lack_a_field_the_reward_reads(api):
    """As the dry run does: a validation row without the field would score 0 with an error at every evaluation."""
    train = uploaded(api.client)
    val = uploaded(api.client, [{"prompt": "Say a", "answer": "a"}, {"prompt": "Say b"}, {"prompt": "Say c"}])
    before = _count(api)
    error = assert_error(api.client.post(JOBS, json=cispo_body(train, validation_file=val)), 400,
                         "'answer'", "validation_file lacks on line(s) 2, 3")
    assert error["param"] == "method.cispo.reward.field" and error["code"] == "missing_reward_field"
    lacking = uploaded(api.client, [{"prompt": "Say a"}, *TRAIN_ROWS])
    assert_error(api.client.post(JOBS, json=cispo_body(lacking)), 400, "training_file lacks on line(s) 1")
    grader = {"type": "string_check", "name": "m", "input": "{{ sample.output_text }}",
              "reference": "{{ item.gold }}", "operation": "eq"}
    error = assert_error(api.client.post(JOBS, json={"model": "tiny-model", "training_file": train, "method": {
        "type": "reinforcement", "reinforcement": {"grader": grader}}}), 400, "'gold'", "training_file lacks")
    assert error["param"] == "method.reinforcement.grader.reference"
    assert _count(api) == before and not api.enqueued.ids
    assert api.client.post(JOBS, json=cispo_body(train, validation_file=uploaded(api.client))).status_code == 200
