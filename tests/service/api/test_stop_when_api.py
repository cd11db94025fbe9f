"""training.stop_when and keep_best over the API: bad values are refused (400) naming the field."""

from __future__ import annotations

import pytest

from tests.service.api.conftest import assert_error, cispo_body, uploaded

JOBS = "/v1/fine_tuning/jobs"
TRAINING = "method.cispo.hyperparameters.training"


def _with(api, training: dict) -> dict:
    body = cispo_body(uploaded(api.client))
    body["method"]["cispo"]["hyperparameters"].setdefault("training", {}).update(training)
    return body


@pytest.mark.parametrize("training, field", [
    ({"eval_interval": 2, "stop_when": {"plateau": {"evals": 0}}}, f"{TRAINING}.stop_when.plateau.evals"),
    ({"eval_interval": 2, "stop_when": {"plateau": {}}}, f"{TRAINING}.stop_when.plateau.evals"),
    ({"eval_interval": 2, "stop_when": {"target": "high"}}, f"{TRAINING}.stop_when.target"),
    ({"eval_interval": 2, "stop_when": {"patience": 3}}, f"{TRAINING}.stop_when.patience"),
    ({"eval_interval": 2, "stop_when": {}}, f"{TRAINING}.stop_when"),
    ({"keep_best": "sometimes"}, f"{TRAINING}.keep_best"),
])
def test_bad_stop_when_values_are_refused_naming_the_field(api, training, field):
    error = assert_error(api.client.post(JOBS, json=_with(api, training)), 400, field)
    assert error["param"] == field


def test_stop_when_needs_evals(api):
    error = assert_error(api.client.post(JOBS, json=_with(api, {"stop_when": {"target": 0.9}})), 400,
                         "training.stop_when decides on evals")
    assert error["param"] == TRAINING


def test_a_valid_stop_when_is_kept_in_the_spec(api):
    training = {"eval_interval": 2, "stop_when": {"plateau": {"evals": 3}, "target": 0.9}, "keep_best": True}
    r = api.client.post(JOBS, params={"dry_run": "true"}, json=_with(api, training))
    assert r.status_code == 200, r.text
    spec = r.json()["spec"]["training"]
    assert spec["stop_when"] == {"plateau": {"evals": 3}, "target": 0.9} and spec["keep_best"] is True
