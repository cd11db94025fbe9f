"""The official openai SDK works against the API unchanged (base_url + api_key), errors included."""

from __future__ import annotations

import io
import warnings

import openai
import pytest

from tests.service.api.conftest import TRAIN_ROWS, cispo_body, jsonl


@pytest.fixture
def sdk(api):
    key = api.client.headers["Authorization"].removeprefix("Bearer ")
    # TestClient is an httpx.Client, so the SDK's requests go straight into the app.
    return openai.OpenAI(api_key=key, base_url="http://testserver/v1", http_client=api.client, max_retries=2)


def test_sdk_round_trip_with_reinforcement_and_string_check(api, sdk):
    f = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(TRAIN_ROWS))), purpose="fine-tune")
    assert f.id.startswith("file-") and f.purpose == "fine-tune"
    assert [x.id for x in sdk.files.list()] == [f.id]
    assert sdk.files.content(f.id).read() == jsonl(TRAIN_ROWS)

    job = sdk.fine_tuning.jobs.create(
        model="tiny-model", training_file=f.id, seed=3, metadata={"exp": "sdk"},
        method={"type": "reinforcement", "reinforcement": {
            "grader": {"type": "string_check", "name": "m", "input": "{{sample.output_text}}",
                       "reference": "{{item.answer}}", "operation": "eq"},
            "hyperparameters": {"batch_size": 2, "n_epochs": 1}}},
        extra_headers={"Idempotency-Key": "sdk-1"},
    )
    assert job.status == "queued" and job.seed == 3 and job.method.type == "reinforcement"
    assert api.enqueued.ids == [job.id]
    assert sdk.fine_tuning.jobs.retrieve(job.id).id == job.id
    assert [j.id for j in sdk.fine_tuning.jobs.list(metadata={"exp": "sdk"})] == [job.id]
    assert [e.message for e in sdk.fine_tuning.jobs.list_events(job.id)] == ["Job created"]
    assert list(sdk.fine_tuning.jobs.checkpoints.list(job.id)) == []
    assert sdk.fine_tuning.jobs.pause(job.id).status == "paused"
    assert sdk.fine_tuning.jobs.resume(job.id).status == "queued"
    assert sdk.fine_tuning.jobs.cancel(job.id).status == "cancelled"


def test_sdk_sees_typed_errors_and_does_not_retry_an_illegal_change(api, sdk):
    f = sdk.files.create(file=("t.jsonl", io.BytesIO(jsonl(TRAIN_ROWS))), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.fine_tuning.jobs.create(model="m", training_file=f.id, extra_body={"method": {
            "type": "cispo", "cispo": {"reward": {"type": "contains"},
                                       "hyperparameters": {"training": {"group_size": 1}}}}})
    assert "group_size" in bad.value.message and bad.value.param == "method.cispo.hyperparameters.training.group_size"
    with pytest.raises(openai.NotFoundError):
        sdk.fine_tuning.jobs.retrieve("ftjob-missing")

    job = sdk.fine_tuning.jobs.create(model="m", training_file=f.id, extra_body={"method": {
        "type": "cispo", "cispo": {"reward": {"type": "contains"}}}})
    sdk.fine_tuning.jobs.cancel(job.id)
    sent = []
    api.client.event_hooks["request"].append(sent.append)
    with pytest.raises(openai.ConflictError):
        sdk.fine_tuning.jobs.cancel(job.id)
    assert len(sent) == 1  # x-should-retry: false stopped the SDK's default retries
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="sk-wrong", base_url="http://testserver/v1", http_client=api.anonymous).files.list()


def test_the_sdk_reads_a_job_without_type_warnings(api, sdk):
    """n_epochs is an int in OpenAI's model: 3 steps of 2 rows over 5 rows (1.2 passes) is reported as 1."""
    f = sdk.files.create(file=("t.jsonl", io.BytesIO(jsonl(TRAIN_ROWS))), purpose="fine-tune")
    body = cispo_body(f.id)
    job = sdk.fine_tuning.jobs.create(model=body.pop("model"), training_file=body.pop("training_file"),
                                      extra_body=body)
    retrieved = sdk.fine_tuning.jobs.retrieve(job.id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pydantic's "Expected `int` but got `float`" serializer warning
        dumped = retrieved.model_dump()
    assert dumped["hyperparameters"] == {"batch_size": 2, "learning_rate_multiplier": 1.0, "n_epochs": 1}
