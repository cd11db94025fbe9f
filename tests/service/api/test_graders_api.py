"""OpenAI graders through the official SDK: reinforcement jobs using each grader type, and graders run/validate."""

from __future__ import annotations

import io

import openai
import pytest
from sqlalchemy import select

from service.db.models import Job
from service.job_spec.spec import JobSpec
from tests.service.api.conftest import TRAIN_ROWS, jsonl, running_api
from tests.worker.rewards.reward_servers import reward_server

GRADE_SOURCE = "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"
STRING_CHECK = {"type": "string_check", "name": "exact", "input": "{{ sample.output_text }}",
                "reference": "{{ item.answer }}", "operation": "eq"}
SIMILAR = {"type": "text_similarity", "name": "close", "input": "{{ sample.output_text }}",
           "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}
PYTHON = {"type": "python", "name": "py", "source": GRADE_SOURCE}
MULTI = {"type": "multi", "name": "combo", "calculate_output": "0.5 * exact + 0.25 * close + 0.25 * py",
         "graders": {"exact": STRING_CHECK, "close": SIMILAR, "py": PYTHON}}


def sdk_for(built) -> openai.OpenAI:
    key = built.client.headers["Authorization"].removeprefix("Bearer ")
    return openai.OpenAI(api_key=key, base_url="http://testserver/v1", http_client=built.client, max_retries=0)


@pytest.fixture
def judge():
    with reward_server() as (base, rec):
        yield base, rec


@pytest.fixture
def judged_api(database_url, tmp_path, judge):
    base, _ = judge
    with running_api(database_url, tmp_path, egress_allow="127.0.0.1", judge_base_url=f"{base}/v1",
                     judge_api_key="judge-key", judge_models="judge-1") as built:
        yield built


def score_model(**overrides) -> dict:
    return {"type": "score_model", "name": "judge", "model": "judge-1", "range": [0, 10],
            "input": [{"role": "system", "content": "Grade the answer."},
                      {"role": "user", "content": [{"type": "input_text", "text": "{{ item.answer }}"}]}],
            "sampling_params": {"temperature": 0.0}, **overrides}


def _create(sdk, grader: dict):
    f = sdk.files.create(file=("train.jsonl", io.BytesIO(jsonl(TRAIN_ROWS))), purpose="fine-tune")
    return sdk.fine_tuning.jobs.create(model="tiny-model", training_file=f.id, seed=1, method={
        "type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": {"batch_size": 2}}})


def _stored_reward(built, job_id: str):
    with built.session() as s:
        return JobSpec.model_validate(s.scalar(select(Job.spec).where(Job.id == job_id))).reward


def test_reinforcement_jobs_map_each_grader_type(judged_api):
    sdk = sdk_for(judged_api)
    reward = _stored_reward(judged_api, _create(sdk, SIMILAR).id)
    assert (reward.type, reward.metric, reward.reference) == ("similarity", "fuzzy_match", "{{ item.answer }}")

    reward = _stored_reward(judged_api, _create(sdk, PYTHON).id)
    assert reward.type == "python" and reward.source.startswith(GRADE_SOURCE) and reward.entry_point.startswith("_")

    job = _create(sdk, MULTI)
    assert job.status == "queued" and job.method.reinforcement.grader.type == "multi"
    reward = _stored_reward(judged_api, job.id)
    assert reward.type == "multi" and reward.formula == MULTI["calculate_output"]
    assert {n: r.type for n, r in reward.rewards.items()} == {"exact": "string_check", "close": "similarity",
                                                              "py": "python"}

    reward = _stored_reward(judged_api, _create(sdk, score_model()).id)
    assert reward.type == "score_model" and reward.range == (0.0, 10.0) and reward.base_url is None
    assert reward.input[1].content == "{{ item.answer }}" and reward.sampling_params.temperature == 0.0
    assert "judge-key" not in str(reward.model_dump())


def test_unsupported_graders_are_refused_by_name_through_the_sdk(api):
    sdk = sdk_for(api)
    with pytest.raises(openai.BadRequestError) as info:
        _create(sdk, {"type": "label_model", "name": "l", "model": "m", "input": [], "labels": ["a"],
                      "passing_labels": ["a"]})
    assert "label_model" in info.value.message and info.value.param == "method.reinforcement.grader.type"
    with pytest.raises(openai.BadRequestError) as info:
        _create(sdk, {**SIMILAR, "evaluation_metric": "cosine"})
    assert "cosine" in info.value.message and info.value.param == "method.reinforcement.grader.evaluation_metric"
    with pytest.raises(openai.BadRequestError) as info:
        _create(sdk, {**MULTI, "graders": {"inner": MULTI}})
    assert "cannot be nested" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        _create(sdk, {**MULTI, "calculate_output": "exact + __import__('os').getpid()"})
    assert info.value.param == "method.reinforcement.grader.calculate_output"
    with pytest.raises(openai.BadRequestError) as info:  # no judge endpoint configured on this service
        _create(sdk, score_model())
    assert "CISPO_JUDGE_BASE_URL" in info.value.message


def test_graders_run_through_the_sdk(api):
    sdk = sdk_for(api)
    run = sdk.fine_tuning.alpha.graders.run(grader=STRING_CHECK, model_sample="Paris", item={"answer": "Paris"})
    assert run.reward == 1.0 and run.metadata.name == "exact" and run.metadata.type == "string_check"
    assert not any(v for k, v in run.metadata.errors.model_dump().items() if isinstance(v, bool))
    assert run.metadata.execution_time > 0 and run.sub_rewards == {}

    run = sdk.fine_tuning.alpha.graders.run(grader=SIMILAR, model_sample="abcd", item={"answer": "acbd"})
    assert run.reward == pytest.approx(0.75)

    run = sdk.fine_tuning.alpha.graders.run(grader=MULTI, model_sample="Paris", item={"answer": "Paris"})
    assert run.reward == pytest.approx(1.0) and run.sub_rewards == {"exact": 1.0, "close": 1.0, "py": 1.0}
    assert run.metadata.scores == run.sub_rewards

    broken = {**PYTHON, "source": "def grade(sample, item):\n    return item['missing']\n"}
    run = sdk.fine_tuning.alpha.graders.run(grader=broken, model_sample="x", item={"answer": "x"})
    assert run.reward == 0.0 and run.metadata.errors.python_grader_runtime_error
    assert "KeyError" in run.metadata.errors.python_grader_runtime_error_details

    run = sdk.fine_tuning.alpha.graders.run(grader=STRING_CHECK, model_sample="x", item={"other": 1})
    assert run.reward == 0.0 and run.metadata.errors.invalid_variable_error


def test_graders_run_a_score_model_on_the_services_judge(judged_api, judge):
    _, rec = judge
    sdk = sdk_for(judged_api)
    run = sdk.fine_tuning.alpha.graders.run(grader=score_model(), model_sample="x", item={"answer": "seven"})
    assert run.reward == 5.0  # the fake judge answers len("seven") on a 0-10 range
    assert run.metadata.sampled_model_name == "judge-1" and run.metadata.token_usage == 15
    assert run.model_grader_token_usage_per_model == {
        "judge-1": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}
    assert rec.requests[-1]["headers"]["Authorization"] == "Bearer judge-key"
    run = sdk.fine_tuning.alpha.graders.run(grader=score_model(), model_sample="x", item={"answer": "refuse"})
    assert run.reward == 0.0 and run.metadata.errors.model_grader_refusal_error


def test_graders_validate_through_the_sdk(api):
    sdk = sdk_for(api)
    valid = sdk.fine_tuning.alpha.graders.validate(grader=STRING_CHECK)
    assert valid.grader.type == "string_check" and valid.grader.name == "exact"
    assert sdk.fine_tuning.alpha.graders.validate(grader=MULTI).grader.type == "multi"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.fine_tuning.alpha.graders.validate(grader={**PYTHON, "source": "def other():\n    pass\n"})
    assert info.value.param == "grader.source" and "def grade" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        sdk.fine_tuning.alpha.graders.validate(grader={**STRING_CHECK,
                                                       "reference": "{{ item.a }} {{ sample.choices }}"})
    assert "sample.choices" in info.value.message
