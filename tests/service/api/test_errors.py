"""Bad input anywhere is a 4xx in OpenAI's envelope that names the problem; never a 500 or a trace."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.api.app import create_app
from service.db.models import Job
from tests.service.api.conftest import _key, assert_error, cispo_body, make_settings, uploaded

JOBS = "/v1/fine_tuning/jobs"


def test_malformed_json_is_400(api):
    r = api.client.post(JOBS, content=b'{"model": "m", ', headers={"content-type": "application/json"})
    assert assert_error(r, 400, "not valid JSON")["code"] == "invalid_json"
    r = api.client.post("/v1/reward_functions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_a_non_object_body_is_400(api):
    assert_error(api.client.post(JOBS, json=[1, 2, 3]), 400, "body")


def test_unknown_routes_and_methods_use_the_envelope(api):
    assert_error(api.client.get("/v1/nothing-here"), 404, "/v1/nothing-here")
    assert_error(api.client.put(JOBS), 405)


def test_missing_and_bad_api_keys_are_401(api):
    assert_error(api.anonymous.get("/v1/files"), 401, "Authorization")
    assert_error(api.anonymous.get("/v1/files", headers={"Authorization": "Bearer sk-cispo-wrong"}), 401, "invalid")
    assert_error(api.anonymous.get("/v1/files", headers={"Authorization": "Basic abc"}), 401, "Bearer")
    r = api.anonymous.post(JOBS, json={"anything": 1})
    assert_error(r, 401)  # authentication comes before validation: no schema hints for strangers
    r = api.anonymous.get("/v1/files", headers={"Authorization": "Bearer sk-cispo-secretvalue"})
    assert "sk-cispo-secretvalue" not in r.text


def test_json_body_over_the_limit_is_413_and_creates_nothing(database_url, tmp_path):
    app = create_app(make_settings(database_url, tmp_path, max_request_bytes=1024), enqueue=lambda _: None)
    client = TestClient(app, headers={"Authorization": f"Bearer {_key(database_url, 'p')}"})
    body = cispo_body(uploaded(client), metadata={"note": "x" * 500, "more": "y" * 500})
    assert_error(client.post(JOBS, json=body), 413, "1024")

    def chunks():  # no Content-Length: only counting the streamed bytes catches it
        yield b'{"model": "'
        for _ in range(64):
            yield b"x" * 64
        yield b'"}'

    r = client.post(JOBS, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "1024")
    with app.state.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def test_an_unexpected_failure_is_a_generic_500_without_details(api, monkeypatch):
    from service import jobs as jobs_service

    def explode(*args, **kwargs):
        raise RuntimeError("secret internals: password=hunter2")

    monkeypatch.setattr(jobs_service, "get", explode)
    r = api.client.get(f"{JOBS}/ftjob-x")
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "hunter2" not in r.text and "Traceback" not in r.text


def test_nul_characters_are_refused_before_they_reach_the_database(api):
    assert_error(api.client.get("/v1/files/file-%00"), 400, "NUL")
    assert_error(api.client.get("/v1/fine_tuning/jobs", params={"after": "x\x00"}), 400, "NUL")
    assert_error(api.client.post(JOBS, json=cispo_body(uploaded(api.client), model="m\x00")), 400, "model", "NUL")
    r = api.client.post("/v1/reward_functions", json={"name": "a\x00", "spec": {"type": "contains"}})
    assert_error(r, 400, "name", "NUL")


def test_lone_surrogates_are_refused_before_they_reach_the_database(api):
    # Valid JSON ("\ud800" escaped) that no UTF-8 column stores: the driver's encode was a 500.
    body = json.dumps(cispo_body(uploaded(api.client), suffix="a\ud800")).encode()
    r = api.client.post(JOBS, content=body, headers={"content-type": "application/json"})
    assert assert_error(r, 400, "suffix", "lone UTF-16 surrogate")["param"] == "suffix"


def test_non_finite_numbers_are_refused_naming_the_field(api):
    file_id = uploaded(api.client)
    for literal, section, field in ((b"Infinity", "loss", "kl_beta"), (b"NaN", "training", "reward_failure_score"),
                                    (b"1e999", "optimizer", "weight_decay")):
        raw = (b'{"model": "m", "training_file": "%s", "method": {"type": "cispo", "cispo": {"reward": '
               b'{"type": "contains"}, "hyperparameters": {"%s": {"%s": %s}}}}}'
               % (file_id.encode(), section.encode(), field.encode(), literal))
        r = api.client.post(JOBS, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, f"method.cispo.hyperparameters.{section}.{field}", "finite")
    with api.session() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0


def test_param_names_the_field_at_fault(api):
    """Not the union tag twice, not the enclosing object, not null."""
    def error(path: str, body: dict) -> dict:
        r = api.client.post(path, json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    bad_schema = {"type": "json_schema", "json_schema": {"type": 12}}
    assert error("/v1/reward_functions", {"name": "s", "spec": bad_schema})["param"] == "spec.json_schema"
    multi = {"type": "multi", "rewards": {"a": {"type": "contains"}}, "weights": {"a": 1.0, "nope": 2.0}}
    got = error("/v1/reward_functions", {"name": "m", "spec": multi})
    assert got["param"] == "spec.weights" and "'nope'" in got["message"]
    got = error("/v1/reward_functions", {"name": "m", "spec": {**multi, "weights": None, "formula": "a + b"}})
    assert got["param"] == "spec.formula" and "'b'" in got["message"]
    got = error("/v1/reward_functions", {"name": "m", "spec": {**multi, "weights": {"a": 1}, "formula": "a"}})
    assert got["param"] == "spec.formula" and "not both" in got["message"]
    exact = {"type": "exact_match", "field": "answer"}
    got = error("/v1/reward_functions/test", {"spec": exact, "completions": ["a"],
                                              "samples": [{"completion": "a", "row": {"answer": "a"}}]})
    assert got["param"] == "samples" and "not both" in got["message"]
    assert error("/v1/reward_functions/test", {"spec": exact})["param"] == "samples"


def _leaf_paths(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaf_paths(v, (*path, k))
    yield path


def _replaced(node, path, value):
    if not path:
        return value
    return {**node, path[0]: _replaced(node[path[0]], path[1:], value)}


def test_no_mutation_of_a_valid_body_causes_a_server_error(api):
    """Every field (and every enclosing object) replaced by values of the wrong type or size: always a 4xx or 200."""
    file_id = uploaded(api.client)
    body = cispo_body(file_id, suffix="s", metadata={"k": "v"}, validation_file=file_id)
    body["method"]["cispo"]["hyperparameters"]["loss"] = {"ratio_max": 5.0}
    oddities = [None, "", "x" * 5000, -1, 0, 2**70, 1e308, True, [], {}, [1, "a"], {"type": "cosine"}]
    statuses = set()
    for path in _leaf_paths(body):
        for odd in oddities:
            r = api.client.post(JOBS, json=_replaced(body, path, odd))  # not a dry run: rows are written
            assert r.status_code < 500, (path, odd, r.text)
            if r.status_code != 200:
                assert "error" in r.json() and r.json()["error"]["message"], (path, odd)
            statuses.add(r.status_code)
    assert {200, 400} <= statuses


def test_an_unreachable_database_is_503_not_500(tmp_path):
    dead = "postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=2"
    app = create_app(make_settings(dead, tmp_path), enqueue=lambda _: None)
    r = TestClient(app, raise_server_exceptions=False).get("/v1/files", headers={"Authorization": "Bearer sk-x"})
    assert_error(r, 503, "database")
    assert r.headers["retry-after"] == "5"


def test_a_real_field_sent_where_it_is_not_supported_says_what_to_use_instead(api):
    """Not "check the spelling" for fields the client chose on purpose; a typo still gets that hint."""
    chat = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(api.client.post("/v1/chat/completions", json={**chat, "logprobs": True}), 400,
                         "logprobs: not supported here", "no log-probabilities")
    assert error["param"] == "logprobs" and "spelling" not in error["message"]
    file_id = uploaded(api.client)
    supervised = {"model": "tiny-model", "training_file": file_id, "method": {"type": "supervised", "supervised": {
        "hyperparameters": {"optimizer": {"lr": 1e-4}}}}}
    error = assert_error(api.client.post(JOBS, json=supervised), 400,
                         "method.supervised.hyperparameters.optimizer: not supported here",
                         "method.cispo.hyperparameters", "learning_rate_multiplier")
    assert error["param"] == "method.supervised.hyperparameters.optimizer"
    assert_error(api.client.post(JOBS, json=cispo_body(file_id, init_from="/ckpt")), 400,
                 "init_from: not supported here", "as `model`")
    assert_error(api.client.post(JOBS, json=cispo_body(file_id, sufix="x")), 400, "sufix: unknown field",
                 "check the spelling")


def test_every_invalid_field_is_the_same_400_on_every_route(api):
    """The request models' errors (once 422) and the service's checks (400) are one kind of error: one status."""
    file_id = uploaded(api.client)
    chat = {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}], "colour": 1}
    for response in (api.client.post(JOBS, json=cispo_body(file_id, colour=1)),
                     api.client.post("/v1/chat/completions", json=chat),
                     api.client.post("/v1/reward_functions", json={"name": "r", "spec": {"type": "contains"},
                                                                   "colour": 1}),
                     api.client.post("/v1/evals", json={"model": "tiny-model", "file": file_id, "colour": 1})):
        error = assert_error(response, 400, "colour: unknown field")
        assert (error["param"], error["code"], error["type"]) == ("colour", "invalid_value", "invalid_request_error")


def test_rows_that_do_not_fit_the_method_name_it_in_plain_words(api):
    chats = [{"messages": [{"role": "user", "content": "a="}, {"role": "assistant", "content": "a"}]}] * 2
    r = api.client.post(JOBS, json=cispo_body(uploaded(api.client, chats)))
    error = assert_error(r, 400, "2 row(s) unusable for a cispo or reinforcement job", "training_file line 1")
    assert "a this" not in error["message"] and error["code"] == "invalid_rows_for_method"
