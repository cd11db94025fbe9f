"""The torch-free scoring engine: remote rewards against real loopback servers, judges, python graders, multi."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from service.egress import EgressPolicy
from service.schemas.graders import grader_reward
from service.schemas.rewards import RewardSpec
from tests.worker.rewards.reward_servers import reward_server
from worker.rewards.engine import ScoringContext, build_scorer
from worker.rewards.errors import error_kind
from worker.rewards.judge import JudgeEndpoint

SPEC = TypeAdapter(RewardSpec)
LOOPBACK = EgressPolicy.from_setting("127.0.0.1")
NO_SLEEP = ScoringContext(egress=LOOPBACK)


def score(spec: dict, completions, rows=None, context: ScoringContext = NO_SLEEP):
    scorer = build_scorer(SPEC.validate_python(spec), context)
    try:
        return scorer.score(list(completions), rows or [{} for _ in completions])
    finally:
        scorer.close()


@pytest.fixture
def no_backoff(monkeypatch):
    slept = []
    monkeypatch.setattr("worker.rewards.remote.backoff_sleep", slept.append)
    return slept


# -- http -------------------------------------------------------------------------------


def test_http_reward_scores_in_batches_and_sends_the_secret_header(no_backoff):
    with reward_server() as (base, rec):
        spec = {"type": "http", "url": f"{base}/good", "auth_secret": "grader-key", "header": "X-Api-Key",
                "batch_size": 2}
        ctx = ScoringContext(secrets={"grader-key": "s3cr3t-value"}, egress=LOOPBACK)
        out = score(spec, ["a", "abcd", "ab"], [{}, {}, {"weight": 0.25}], ctx)
    assert out.scores == [0.1, 0.4, 0.25] and out.errors == [None] * 3
    assert [len(r["body"]["samples"]) for r in rec.requests] == [2, 1]
    assert rec.requests[1]["body"]["samples"] == [{"completion": "ab", "row": {"weight": 0.25}}]
    assert all(r["headers"]["X-Api-Key"] == "s3cr3t-value" for r in rec.requests)


def test_http_reward_timeouts_are_retried_then_become_sample_errors(no_backoff):
    with reward_server() as (base, rec):
        out = score({"type": "http", "url": f"{base}/slow", "timeout_s": 0.3, "retries": 2}, ["a", "b"])
    assert out.scores == [None, None]
    assert out.errors[0] == "http: timed out (ReadTimeout) after 3 attempts" and error_kind(out.errors[0]) == "timeout"
    assert len(rec.requests) == 3 and no_backoff == [0.5, 1.0]  # exponential backoff


def test_http_reward_5xx_is_retried_and_can_recover(no_backoff):
    with reward_server() as (base, rec):
        rec.fail_first = 2
        out = score({"type": "http", "url": f"{base}/flaky", "retries": 3}, ["abc"])
    assert out.scores == [pytest.approx(0.3)] and out.errors == [None]
    assert len(rec.requests) == 3 and no_backoff == [0.5, 1.0]


def test_http_reward_garbage_and_wrong_length_fail_the_batch_without_retries(no_backoff):
    with reward_server() as (base, rec):
        garbage = score({"type": "http", "url": f"{base}/garbage"}, ["a", "b"])
        wrong = score({"type": "http", "url": f"{base}/wrong-count"}, ["a", "b", "c"])
        mixed = score({"type": "http", "url": f"{base}/mixed"}, ["a", "b", "c", "d"])
    assert garbage.scores == [None, None] and "not JSON" in garbage.errors[0]
    assert error_kind(garbage.errors[0]) == "http"
    assert wrong.errors == ["http: the response has 2 scores for 3 samples"] * 3
    assert len(rec.requests) == 3 and no_backoff == []  # permanent failures are not retried
    # per-sample problems fail only those samples
    assert mixed.scores == [1.0, None, None, None]
    assert mixed.errors[1] == "http: the endpoint returned NoneType, not a number"
    assert mixed.errors[2] == "http: the endpoint returned str, not a number"


def test_http_reward_never_leaks_the_secret_in_errors(no_backoff):
    with reward_server() as (base, _):
        ctx = ScoringContext(secrets={"k": "Bearer TOPSECRET"}, egress=LOOPBACK)
        out = score({"type": "http", "url": f"{base}/echo-auth", "auth_secret": "k", "retries": 0}, ["a"], None, ctx)
    assert out.errors == ["http: HTTP 500"]


def test_http_reward_refuses_loopback_unless_allow_listed_and_missing_secrets():
    out = score({"type": "http", "url": "http://127.0.0.1:9/x"}, ["a"], None, ScoringContext())
    assert "non-public" in out.errors[0] and out.scores == [None]
    with pytest.raises(ValueError, match="needs the secret 'nope'"):
        build_scorer(SPEC.validate_python({"type": "http", "url": "https://example.com", "auth_secret": "nope"}),
                     ScoringContext())


# -- score_model -----------------------------------------------------------------------


def test_score_model_renders_parses_clamps_and_counts_tokens():
    with reward_server() as (base, rec):
        ctx = ScoringContext(egress=LOOPBACK, judge=JudgeEndpoint(f"{base}/v1", "judge-key"))
        spec = {"type": "score_model", "model": "judge-1", "range": [0, 5],
                "input": [{"role": "developer", "content": "Grade."},
                          {"role": "user", "content": "{{ item.q }}: {{ sample.output_text }}"}],
                "sampling_params": {"temperature": 0, "max_completions_tokens": 50}}
        out = score(spec, ["ab", "prose", "refuse", "silent", "x"], [{"q": "Q"}] * 4 + [{}], ctx)
    assert out.scores[0] == 5.0  # {"result": 5} for "Q: ab", clipped to the range's top
    assert out.scores[1] == 0.8  # the last number of a prose reply
    # The judge's own words never come back (they would make the judge a chat endpoint for anyone).
    assert "I cannot grade" not in out.errors[2] and error_kind(out.errors[2]) == "judge_refusal"
    assert out.errors[3] == "judge reply: no number in the judge's reply (11 characters, not shown)"
    assert error_kind(out.errors[3]) == "judge_parse"
    assert error_kind(out.errors[4]) == "invalid_variable"  # the row has no q: never sent
    assert out.usage == {"judge-1": {"prompt_tokens": 40, "completion_tokens": 20, "total_tokens": 60}}
    first = rec.requests[0]
    assert first["headers"]["Authorization"] == "Bearer judge-key" and first["path"] == "/v1/chat/completions"
    body = first["body"]
    assert body["temperature"] == 0 and body["max_tokens"] == 50 and body["model"] == "judge-1"
    assert [m["role"] for m in body["messages"]] == ["system", "system", "user"]  # ours, then developer as system


def test_the_operators_judge_caps_each_replys_tokens():
    spec = {"type": "score_model", "model": "judge-1", "input": [{"role": "user", "content": "{{ sample.output_text }}"}]}
    with reward_server() as (base, rec):
        capped = ScoringContext(egress=LOOPBACK, judge=JudgeEndpoint(f"{base}/v1", "k", max_tokens=100))
        score(spec, ["a"], [{}], capped)  # asks for no limit: gets the cap
        score({**spec, "sampling_params": {"max_completions_tokens": 40}}, ["a"], [{}], capped)  # under it: its own
        score({**spec, "sampling_params": {"max_completions_tokens": 4000}}, ["a"], [{}], capped)  # over: the cap
    assert [r["body"]["max_tokens"] for r in rec.requests] == [100, 40, 100]


def test_score_model_without_an_endpoint_is_refused_at_build_time():
    with pytest.raises(ValueError, match="judge endpoint"):
        build_scorer(SPEC.validate_python({"type": "score_model", "model": "m",
                                           "input": [{"role": "user", "content": "x"}]}), ScoringContext())


# -- python graders and multi -------------------------------------------------------------

GRADE = '''
def grade(sample, item):
    if item.get("boom"):
        return 1 / 0
    out = sample["output_json"]
    bonus = 0.5 if isinstance(out, dict) else 0.0
    return float(sample["output_text"].strip() == item["answer"]) + bonus
'''


def test_python_grader_runs_in_the_sandbox_with_sample_and_item():
    reward = grader_reward({"type": "python", "name": "p", "source": GRADE}, param="grader")
    out = score(reward, ["42", '{"a": 1}', "41", "x"], [{"answer": "42"}, {"answer": "?"}, {"answer": "42"},
                                                          {"boom": True}])
    assert out.scores == [1.0, 0.5, 0.0, None]
    assert out.errors[3] == "ZeroDivisionError: division by zero" and error_kind(out.errors[3]) == "exception"


def test_multi_reports_parts_and_combines_by_formula_or_weights():
    parts = {"exact": {"type": "exact_match"}, "short": {"type": "length", "target": 1, "scale": 4, "unit": "chars"}}
    formula = score({"type": "multi", "rewards": parts, "formula": "0.5 * exact + 0.5 * short"},
                    ["Paris", "paris!", "x"], [{"answer": "paris"}, {"answer": "paris"}, {}])
    # short: "Paris" d=4 -> 0; "paris!" d=5 -> 0; "x" -> 1.  exact: 1, 0, error (no answer)
    assert formula.components["exact"].scores == [1.0, 0.0, None]
    assert formula.components["short"].scores == [0.0, 0.0, 1.0]
    assert formula.scores == [0.5, 0.0, None]
    assert formula.errors[2].startswith("exact: KeyError")
    weighted = score({"type": "multi", "rewards": parts, "weights": {"exact": 2.0, "short": 0.0}},
                     ["x"], [{}])
    assert weighted.errors[0].startswith("exact: KeyError")  # a needed part failed
    only_short = score({"type": "multi", "rewards": parts, "weights": {"exact": 0.0}}, ["x"], [{}])
    assert only_short.scores == [1.0]  # a zero-weight part's failure does not matter
    undefined = score({"type": "multi", "rewards": parts, "formula": "exact / short"}, ["Paris"], [{"answer": "paris"}])
    assert undefined.errors == ["formula: ZeroDivisionError: float division by zero"]
    assert error_kind(undefined.errors[0]) == "formula"
