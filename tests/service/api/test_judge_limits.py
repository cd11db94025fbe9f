"""The operator's judge (CISPO_JUDGE_BASE_URL) is no free LLM proxy: listed models only, capped replies, the
judge's text never shown, a per-project token budget. Against a fake OpenAI-compatible judge on loopback."""

from __future__ import annotations

import pytest

from tests.service.api.conftest import assert_error, running_api
from tests.worker.rewards.reward_servers import reward_server


def judge_spec(**overrides) -> dict:
    return {"type": "score_model", "model": "judge-1", "range": [0, 10],
            "input": [{"role": "user", "content": "{{ sample.output_text }}"}], **overrides}


@pytest.fixture
def judged(database_url, tmp_path):
    with reward_server() as (base, rec), running_api(
            database_url, tmp_path, egress_allow="127.0.0.1", judge_base_url=f"{base}/v1", judge_api_key="op-key",
            judge_models="judge-1, judge-2", judge_max_tokens=256, judge_tokens_per_project_hour=45) as api:
        rec.base = base
        yield api, rec


def test_only_listed_models_and_capped_replies_reach_the_judge(judged):
    api, rec = judged
    r = api.client.post("/v1/reward_functions/test", json={"spec": judge_spec(model="gpt-5"), "completions": ["a"]})
    error = assert_error(r, 400, "spec.model", "'gpt-5' is not a model this service's judge offers", "'judge-1'")
    assert error["param"] == "spec.model" and error["code"] == "judge_model_not_allowed"
    r = api.client.post("/v1/reward_functions/test", json={
        "spec": judge_spec(sampling_params={"max_completions_tokens": 65536}), "completions": ["a"]})
    error = assert_error(r, 400, "65536 is more than this service's judge gives one reply (256)")
    assert error["param"] == "spec.sampling_params.max_completions_tokens"
    # Jobs' graders are checked the same way (a reward function is what a job names).
    r = api.client.post("/v1/reward_functions", json={"name": "j", "spec": judge_spec(model="gpt-5")})
    assert r.status_code == 400 and "not a model this service's judge offers" in r.text, r.text
    assert rec.requests == []  # nothing reached the judge

    r = api.client.post("/v1/reward_functions/test", json={"spec": judge_spec(), "completions": ["silent"]})
    assert r.status_code == 200, r.text
    assert rec.requests[-1]["body"]["max_tokens"] == 256 and rec.requests[-1]["body"]["model"] == "judge-1"
    assert "No opinion" not in r.text  # the judge's reply text is never echoed
    assert r.json()["results"][0]["error_kind"] == "judge_parse"


def test_a_judge_score_is_bounded_and_keeps_four_digits_of_its_range(judged):
    api, rec = judged
    for huge in ([0, 1e300], [-1e5, 1]):
        for route, body, field in (
                ("/v1/reward_functions/test", {"spec": judge_spec(range=huge), "completions": ["a"]}, "spec.range"),
                ("/v1/fine_tuning/alpha/graders/validate", {"grader": {**judge_spec(range=huge), "name": "j"}},
                 "grader.range")):
            r = api.client.post(route, json=body)
            error = assert_error(r, 400, "each end must lie from -10000 to 10000")
            assert error["param"] == field, error
    assert rec.requests == []
    r = api.client.post("/v1/reward_functions/test", json={"spec": judge_spec(range=[0, 1]), "completions": ["digits"]})
    assert r.status_code == 200 and r.json()["scores"] == [0.1235], r.text  # not 0.123456789012345
    r = api.client.post("/v1/reward_functions/test", json={"spec": judge_spec(range=[0, 100]),
                                                           "completions": ["digits"]})
    assert r.json()["scores"] == [0.12], r.text


def test_a_project_over_its_judge_budget_gets_429_and_others_go_on(judged):
    api, rec = judged
    body = {"spec": judge_spec(), "completions": ["aa", "bbb"]}  # the fake judge reports 15 tokens a call
    assert api.client.post("/v1/reward_functions/test", json=body).json()["scores"] == [2.0, 3.0]  # 30 of 45
    assert api.client.post("/v1/reward_functions/test", json=body).status_code == 200  # 60: over from now on
    sent = len(rec.requests)
    r = api.client.post("/v1/reward_functions/test", json=body)
    error = assert_error(r, 429, "judge budget: this project used 60 tokens", "the limit is 45")
    assert error["code"] == "judge_budget_exceeded" and int(r.headers["retry-after"]) > 3000
    r = api.client.post("/v1/fine_tuning/alpha/graders/run", json={"grader": {**judge_spec(), "name": "j"},
                                                                    "model_sample": "x"})
    assert r.status_code == 429  # graders/run spends the same budget
    assert len(rec.requests) == sent  # refused before the judge was called
    assert api.other.post("/v1/reward_functions/test", json=body).status_code == 200  # another project's own budget
    # A grader on the tenant's own endpoint is the tenant's spend, not the budget's.
    own = judge_spec(model="anything", base_url=f"{rec.base}/v1")
    r = api.client.post("/v1/reward_functions/test", json={"spec": own, "completions": ["a"]})
    assert r.status_code == 200 and r.json()["scores"] == [1.0], r.text


def test_the_budget_is_a_sliding_hour():
    from service.api.judge_budget import JudgeBudget
    from service.errors import TooManyRequests

    now = [1000.0]
    budget = JudgeBudget(100, clock=lambda: now[0])
    budget.charge("p", 60)
    now[0] += 1800
    budget.charge("p", 50)
    budget.check("q")  # another project's budget is its own
    with pytest.raises(TooManyRequests) as refused:
        budget.check("p")
    assert refused.value.retry_after_s == pytest.approx(1800)  # when the first 60 age out
    now[0] += 1800  # the first charge is an hour old: 50 left in the window
    budget.check("p")
    assert budget.used("p") == 50
    now[0] += 1800
    assert budget.used("p") == 0
