"""The json_schema reward: a schema's user regexes (pattern, patternProperties) run in the killable regex child."""

from __future__ import annotations

import json
import time

from service.schemas.reward_checks import JsonSchemaReward
from tests.worker.rewards.fresh_scorer import score_in_a_fresh_process
from worker.rewards.errors import error_kind
from worker.rewards.json_checks import JsonSchemaBatchScorer

CATASTROPHIC = r"^(a+)+$"  # exponential on "aaaa...ab"
HANGS = "a" * 40 + "b"
BY_PATTERN = JsonSchemaReward(json_schema={"type": "object", "properties": {"name": {"pattern": CATASTROPHIC}}})
BY_KEY = JsonSchemaReward(json_schema={"type": "object", "patternProperties": {CATASTROPHIC: {"type": "integer"}},
                                       "additionalProperties": False})


def score(spec: JsonSchemaReward, texts: list[str], **deadlines):
    scorer = JsonSchemaBatchScorer(spec, **deadlines)
    try:
        return scorer.score(texts, [{}] * len(texts))
    finally:
        scorer.close()


def test_patterns_and_pattern_properties_are_matched():
    out = score(BY_PATTERN, ['{"name": "aaa"}', '{"name": "ab"}', '{"other": 1}', "[]", "no json"])
    assert out.scores == [1.0, 0.0, 1.0, 0.0, 0.0] and out.errors == [None] * 5
    out = score(BY_KEY, ['{"aa": 1}', '{"aa": "x"}', '{"ab": 1}', "{}"])
    assert out.scores == [1.0, 0.0, 0.0, 1.0]  # "ab" is no pattern property, so additionalProperties refuses it


def test_nan_and_infinity_are_not_json_to_a_schema():
    spec = JsonSchemaReward(json_schema={"type": "object"})
    out = score(spec, ['{"a": 1}', '{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}'])
    assert out.scores == [1.0, 0.0, 0.0, 0.0] and out.errors == [None] * 4


def test_a_backtracking_pattern_times_out_that_sample_only():
    cases = ((BY_PATTERN, ['{"name": "a"}', json.dumps({"name": HANGS}), '{"name": "aa"}']),
             (BY_KEY, ['{"aa": 1}', json.dumps({HANGS: 1}), '{"a": 2}']))
    for spec, texts in cases:
        started = time.monotonic()
        out = score(spec, texts, timeout_s=0.5)
        elapsed = time.monotonic() - started
        assert out.scores == [1.0, None, 1.0], spec  # the texts after the hang were validated by a new child
        assert out.errors[1] == "json_schema: timed out after 0.5 s" and error_kind(out.errors[1]) == "timeout"
        assert elapsed < 8, elapsed  # two child start-ups, one 0.5 s deadline


def test_a_schema_that_fails_on_a_sample_is_that_sample_s_error():
    spec = JsonSchemaReward(json_schema={"properties": {"a": {"$ref": "https://example.invalid/s.json"}}})
    out = score(spec, ['{"a": 1}', '{"b": 1}'])
    assert out.scores == [None, 1.0]
    assert out.errors[0].startswith("json_schema: ") and "example.invalid" in out.errors[0]


def test_the_trainer_process_never_runs_the_schema_s_patterns():
    """Through the engine as the trainer builds it, in a separate process so that a hang fails, not blocks."""
    scores, errors = score_in_a_fresh_process(BY_PATTERN, [json.dumps({"name": HANGS}), '{"name": "aa"}'])
    assert scores == [None, 1.0] and error_kind(errors[0]) == "timeout"
