"""The Tinker API over HTTP (service/api/routes/tinker.py): the real app over a real database, with the runner's
side played by the repository functions the runner calls (service/repositories/tinker.py), and the real SDK's
ServiceClient against a live server."""

from __future__ import annotations

import json
import threading
import time

import pytest

from service.api.routes.tinker import SERVED_LOSSES
from service.db.session import session_factory
from service.repositories import tinker as repo
from tests.service.api.conftest import Api, LiveServer, running_api

BASE = "tiny-base"
SETTINGS = {"tinker_base_models": BASE, "tinker_poll_hold_s": 0.3}


@pytest.fixture
def api(database_url, tmp_path) -> Api:
    with running_api(database_url, tmp_path, **SETTINGS) as built:
        yield built


def _key(client) -> str:
    return client.headers["Authorization"].removeprefix("Bearer ")


def _session(client) -> str:
    r = client.post("/api/v1/create_session", json={"tags": ["t"], "user_metadata": None, "sdk_version": "0.38.0"})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def _create_model(client, session_id: str, model_seq_id: int = 0):
    return client.post("/api/v1/create_model", json={
        "session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE,
        "lora_config": {"rank": 8, "train_mlp": True, "train_attn": True, "train_unembed": False},
        "type": "create_model"})


def _model(client) -> str:
    r = _create_model(client, _session(client))
    assert r.status_code == 200, r.text
    return r.json()["model_id"]


def _forward_backward_body(model_id: str, seq_id: int, loss_fn: str = "cross_entropy") -> bytes:
    pytest.importorskip("tinker")
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn), model_id=model_id,
        seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def _post_proto(client, body: bytes):
    return client.post("/api/v1/forward_backward", content=body,
                       headers={"Content-Type": "application/x-protobuf"})


def _run_one(api: Api, result: bytes, result_type: str = "json", *, fail: str | None = None) -> repo.RequestRow:
    """The runner's side: claim the next ready request and end it."""
    with session_factory(api.database_url)() as s:
        (row,) = repo.claim_ready(s, "test-runner", time.time(), limit=1)
        if fail is None:
            assert repo.complete(s, row.id, result, result_type)
        else:
            assert repo.fail(s, row.id, fail, "user")
        s.commit()
    return row


def _retrieve(client, request_id: str):
    return client.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": True})


def test_the_sdk_s_key_header_with_or_without_tml_authenticates(api):
    key = _key(api.client)
    for sent in (f"tml-{key}", key):
        r = api.anonymous.post("/api/v1/create_session", headers={"X-API-Key": sent},
                               json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})
        assert r.status_code == 200, r.text
    assert api.anonymous.post("/api/v1/create_session", headers={"X-API-Key": "tml-wrong"}, json={}).status_code == 401
    assert api.anonymous.post("/api/v1/create_session", json={}).status_code == 401


def test_a_retried_submission_answers_the_same_request_and_adds_one_row(api):
    model_id = _model(api.client)
    body = _forward_backward_body(model_id, 1)
    first, again = _post_proto(api.client, body), _post_proto(api.client, body)
    assert first.status_code == 200, first.text
    assert first.json()["request_id"] == again.json()["request_id"]
    _run_one(api, b'{"model_id":"%s"}' % model_id.encode())  # create_model, seq 0
    row = _run_one(api, b"\x0a\x00", "protobuf")
    assert (row.id, row.kind, row.seq_id, row.body) == (first.json()["request_id"], "forward_backward", 1, body)
    with session_factory(api.database_url)() as s:
        assert repo.claim_ready(s, "test-runner", time.time() + 60) == []  # no second row


def test_retrieve_future_answers_try_again_then_the_result_the_runner_wrote(api):
    session_id = _session(api.client)
    created = _create_model(api.client, session_id).json()
    r = _retrieve(api.client, created["request_id"])
    assert r.status_code == 200 and r.json() == {"type": "try_again", "request_id": created["request_id"],
                                                 "queue_state": "active"}
    _run_one(api, json.dumps({"model_id": created["model_id"]}).encode())
    r = _retrieve(api.client, created["request_id"])
    assert r.status_code == 200 and r.json() == {"model_id": created["model_id"]}
    step = _post_proto(api.client, _forward_backward_body(created["model_id"], 1)).json()
    _run_one(api, b"\x0a\x03abc", "protobuf")
    r = _retrieve(api.client, step["request_id"])
    assert r.headers["content-type"] == "application/x-protobuf" and r.content == b"\x0a\x03abc"


def test_a_held_poll_answers_as_soon_as_the_row_ends(database_url, tmp_path):
    with running_api(database_url, tmp_path, **{**SETTINGS, "tinker_poll_hold_s": 20}) as api:
        created = _create_model(api.client, _session(api.client)).json()
        threading.Timer(0.5, lambda: _run_one(api, b'{"model_id":"m"}')).start()
        started = time.monotonic()
        r = _retrieve(api.client, created["request_id"])
        assert r.json() == {"model_id": "m"} and time.monotonic() - started < 5


def test_a_failed_request_answers_the_sdk_s_error_shape(api):
    created = _create_model(api.client, _session(api.client)).json()
    _run_one(api, b"", fail="lora rank too large for this base")
    r = _retrieve(api.client, created["request_id"])
    assert r.status_code == 200 and r.json() == {"error": "lora rank too large for this base", "category": "user"}


def test_a_result_survives_an_api_restart(database_url, tmp_path):
    with running_api(database_url, tmp_path, **SETTINGS) as api:
        created = _create_model(api.client, _session(api.client)).json()
        _run_one(api, b'{"model_id":"kept"}')
        key = _key(api.client)
    with running_api(database_url, tmp_path / "again", **SETTINGS) as restarted:
        r = restarted.anonymous.post("/api/v1/retrieve_future", headers={"X-API-Key": f"tml-{key}"},
                                     json={"request_id": created["request_id"]})
        assert r.status_code == 200 and r.json() == {"model_id": "kept"}


def test_another_project_s_request_model_and_checkpoint_are_not_found(api):
    created = _create_model(api.client, _session(api.client)).json()
    model_id = created["model_id"]
    with session_factory(api.database_url)() as s:
        path = repo.checkpoint_path(model_id, "weights", "final")
        repo.record_checkpoint(s, path=path, project_id=_project_id(api), model_id=model_id, kind="weights", storage_key="k")
        s.commit()
    other_session = _session(api.other)
    assert _retrieve(api.other, created["request_id"]).status_code == 404
    assert _retrieve(api.client, "treq_nonexistent").status_code == 404
    assert api.other.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1,
                                                      "adam_params": {"learning_rate": 1e-4}}).status_code == 404
    assert api.other.post("/api/v1/get_info", json={"model_id": model_id}).status_code == 404
    for r in (api.other.post("/api/v1/create_sampling_session", json={"session_id": other_session,
                                                                      "sampling_session_seq_id": 0,
                                                                      "model_path": path}),
              api.other.post("/api/v1/load_weights", json={"session_id": other_session, "model_seq_id": 0,
                                                           "path": path, "optimizer": True})):
        assert r.status_code == 404 and "path" in r.json()["error"]["message"], r.text
    # its own project resolves it
    r = api.client.post("/api/v1/create_sampling_session", json={"session_id": _session(api.client),
                                                                 "sampling_session_seq_id": 0, "model_path": path})
    assert r.status_code == 200, r.text
    sampler = api.client.get(f"/api/v1/samplers/{r.json()['sampling_session_id']}").json()
    assert sampler["base_model"] == BASE and sampler["model_path"] == path


def _project_id(api: Api) -> str:
    from service.repositories import projects

    with session_factory(api.database_url)() as s:
        return projects.get_or_create_project(s, "alpha").id


def test_quota_refusals_are_4xx_that_name_the_quota(database_url, tmp_path):
    with running_api(database_url, tmp_path, **SETTINGS, tinker_max_training_clients=1,
                     tinker_max_saved_states=1) as api:
        session_id = _session(api.client)
        first = _create_model(api.client, session_id)
        assert _create_model(api.client, session_id).json() == first.json()  # a retry takes no new place
        r = _create_model(api.client, session_id, model_seq_id=1)
        assert r.status_code == 400 and "tinker_max_training_clients" in r.json()["error"]["message"]
        model_id = first.json()["model_id"]
        with session_factory(api.database_url)() as s:
            repo.record_checkpoint(s, path=repo.checkpoint_path(model_id, "weights", "a"),
                                   project_id=_project_id(api), model_id=model_id, kind="weights", storage_key="k")
            s.commit()
        r = api.client.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "b"})
        assert r.status_code == 400 and "tinker_max_saved_states" in r.json()["error"]["message"]
        r = api.client.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "a",
                                                          "overwrite": True})
        assert r.status_code == 200, r.text  # overwriting takes no new place


def test_what_the_server_does_not_serve_is_refused_by_name(api):
    model_id = _model(api.client)
    r = _post_proto(api.client, _forward_backward_body(model_id, 1, loss_fn="stable_reinforce"))
    assert r.status_code == 400 and "stable_reinforce" in r.json()["error"]["message"]
    r = api.client.post("/api/v1/create_custom_loss", json={})
    assert r.status_code == 404 and r.json()["category"] == "user" and "create_custom_loss" in r.json()["error"]
    r = api.client.post("/api/v1/create_model", json={"session_id": _session(api.client), "model_seq_id": 1,
                                                 "base_model": "some/other-model"})
    assert r.status_code == 400 and "base_model" in r.json()["error"]["message"]


def test_bad_input_is_a_4xx_naming_the_field_never_a_500(api):
    model_id = _model(api.client)
    cases = [
        _post_proto(api.client, b"\xff\xff\xff"),
        api.client.post("/api/v1/optim_step", content=b"{not json", headers={"Content-Type": "application/json"}),
        api.client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1}),
        api.client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": "x", "adam_params": {}}),
        api.client.post("/api/v1/asample", json={"sampling_session_id": "nope", "seq_id": 0, "prompt": {},
                                                 "sampling_params": {}}),
        api.client.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "../x"}),
        api.client.post("/api/v1/load_weights", json={"path": "tinker://x", "optimizer": False}),
        api.client.post("/api/v1/session_heartbeat", json={}),
    ]
    for r in cases:
        assert 400 <= r.status_code < 500 and r.status_code != 409, (r.status_code, r.text)
    assert "adam_params" in cases[2].json()["error"]["message"]
    assert "seq_id" in cases[3].json()["error"]["message"]
    assert "session_id" in cases[7].json()["error"]["message"]


def test_a_session_whose_heartbeats_stopped_ends_and_its_model_is_released(api):
    session_id = _session(api.client)
    model_id = _create_model(api.client, session_id).json()["model_id"]
    assert api.client.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
    with session_factory(api.database_url)() as s:
        assert repo.expire_sessions(s, time.time() + 600, 60) == [model_id]
        s.commit()
    assert api.client.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 410
    r = api.client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1,
                                                    "adam_params": {"learning_rate": 1e-4}})
    assert r.status_code == 400 and "released" in r.json()["error"]["message"]
    assert api.client.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": "x"}).status_code == 200


def test_asample_answers_one_sequence_id_per_sample_the_same_on_a_retry(api):
    session_id = _session(api.client)
    sampler = api.client.post("/api/v1/create_sampling_session", json={
        "session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE}).json()["sampling_session_id"]
    body = {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 3,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 4, "temperature": 1.0}}
    first, again = (api.client.post("/api/v1/asample", json=body) for _ in range(2))
    assert first.status_code == 200, first.text
    assert first.json() == again.json() and len(set(first.json()["sample_sequence_ids"])) == 3


def test_the_served_losses_are_the_engine_s():
    pytest.importorskip("torch")
    from worker.engine.losses import LOSSES

    assert set(SERVED_LOSSES) == set(LOSSES)


def test_the_real_sdk_creates_a_session_and_reads_capabilities(api, monkeypatch):
    pytest.importorskip("tinker")
    import tinker

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with LiveServer(api.app) as base, \
            tinker.ServiceClient(base_url=base, api_key=f"tml-{_key(api.client)}") as client:
        rest = tinker.RestClient(base_url=base, api_key=f"tml-{_key(api.client)}")
        capabilities = rest.get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == [BASE]
        with session_factory(api.database_url)() as s:
            assert repo.heartbeat(s, _project_id(api), client.holder.get_session_id()) is True


def test_the_real_sdk_waits_on_a_future_until_the_runner_ends_its_row(api, monkeypatch):
    """create_lora_training_client: the SDK submits create_model, polls its future (try_again while pending),
    gets the runner's result and reads the model's info, all from the rows."""
    pytest.importorskip("tinker")
    import tinker

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    stop = threading.Event()

    def runner():
        while not stop.is_set():
            with session_factory(api.database_url)() as s:
                for row in repo.claim_ready(s, "test-runner", time.time()):
                    assert row.kind == "create_model" and row.seq_id == repo.CREATE_SEQ_ID
                    repo.complete(s, row.id, json.dumps({"model_id": row.model_id}).encode(), "json")
                s.commit()
            time.sleep(0.7)  # longer than the poll hold: the SDK sees try_again first

    thread = threading.Thread(target=runner, daemon=True)
    thread.start()
    try:
        with LiveServer(api.app) as base, \
                tinker.ServiceClient(base_url=base, api_key=f"tml-{_key(api.client)}") as client:
            training = client.create_lora_training_client(base_model=BASE, rank=8).result()
            info = training.get_info()
            assert info.model_id.endswith(":train:0") and info.lora_rank == 8
            assert info.model_data.model_name == BASE
    finally:
        stop.set()
        thread.join(timeout=5)


class StandInRunner:
    """Plays worker/tinker/'s part through the repository functions it calls: claims ready rows and answers
    each kind as the runner would (results encoded by service/tinker/wire.py), with no model behind it. It
    records the order in which each model's calls ran."""

    def __init__(self, database_url: str):
        self.database_url, self.ran = database_url, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)

    def loop(self):
        while not self.stop.wait(0.05):
            with session_factory(self.database_url)() as s:
                for row in repo.claim_ready(s, "stand-in", time.time()):
                    self.ran.append((row.model_id, row.seq_id, row.kind))
                    result, result_type = self.answer(s, row)
                    repo.complete(s, row.id, result, result_type)
                s.commit()

    def answer(self, s, row: repo.RequestRow) -> tuple[bytes, str]:
        from service.tinker import wire

        if row.kind in ("forward_backward", "forward"):
            call = wire.decode_forward_backward(row.body)
            logprobs = [[-1.0] * len(d.inputs["target_tokens"]) for d in call.datums]
            return wire.encode_forward_backward(logprobs, {"loss:sum": float(len(call.datums))}), "protobuf"
        if row.kind == "asample":
            body = json.loads(row.body)
            sequences = [([7, 8], [-0.5, -0.25], "length") for _ in range(body["num_samples"])]
            return wire.encode_sample(sequences, None), "protobuf"
        body = json.loads(row.body)
        if row.kind in ("create_model", "load_weights"):
            answer = {"model_id": row.model_id, "path": body.get("path")}
        elif row.kind == "optim_step":
            answer = {"metrics": {"grad_norm:mean": 0.5}}
        elif row.kind == "save_weights_for_sampler" and body.get("path") is None:
            sampler_id = repo.sampler_id_for(row.session_id, body["sampling_session_seq_id"])
            repo.set_sampler_weights(s, sampler_id, f"snapshot-of-{row.model_id}")
            answer = {"sampling_session_id": sampler_id}
        else:  # save_weights, a named save_weights_for_sampler
            kind = "weights" if row.kind == "save_weights" else "sampler_weights"
            path = repo.checkpoint_path(row.model_id, kind, body["path"])
            repo.record_checkpoint(s, path=path, project_id=row.project_id, model_id=row.model_id, kind=kind,
                                   storage_key=f"objects/{row.id}")
            answer = {"path": path}
        return json.dumps(answer).encode(), "json"


def test_the_real_sdk_trains_samples_saves_and_resumes_over_the_request_rows(api, monkeypatch):
    pytest.importorskip("tinker")
    import tinker
    from tinker import types

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with LiveServer(api.app) as base, StandInRunner(api.database_url) as runner, \
            tinker.ServiceClient(base_url=base, api_key=f"tml-{_key(api.client)}") as client:
        training = client.create_lora_training_client(base_model=BASE, rank=8,
                                                      user_metadata={"renderer_name": "role_colon"}).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
        fb = training.forward_backward([datum, datum], "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-4))
        out = fb.result()
        assert step.result().metrics == {"grad_norm:mean": 0.5}
        assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0] * 3] * 2
        saved = training.save_state("step1").result()
        assert saved.path == f"tinker://{training.model_id}/weights/step1"
        sampler = training.save_weights_and_get_sampling_client().result()
        sample = sampler.sample(types.ModelInput.from_ints([1, 2]), num_samples=2,
                                sampling_params=types.SamplingParams(max_tokens=2)).result()
        assert [s.tokens for s in sample.sequences] == [[7, 8], [7, 8]]
        assert len({s.sequence_id for s in sample.sequences}) == 2
        resumed = client.create_training_client_from_state_with_optimizer(saved.path).result()
        assert resumed.model_id.endswith(":train:1") and resumed.get_info().lora_rank == 8
        run = tinker.RestClient(base_url=base, api_key=f"tml-{_key(api.client)}") \
            .get_training_run_by_tinker_path(saved.path).result()
        assert (run.training_run_id, run.base_model, run.lora_rank) == (training.model_id, BASE, 8)
        assert run.user_metadata == {"renderer_name": "role_colon"}  # the cookbook's, read back on resume
        first = [(seq, kind) for model, seq, kind in runner.ran if model == training.model_id]
        assert first == [(0, "create_model"), (1, "forward_backward"), (2, "optim_step"), (3, "save_weights"),
                         (4, "save_weights_for_sampler")]


def test_a_large_forward_backward_arrives_in_chunks_first_chunk_last_and_runs_in_seq_id_order(api, monkeypatch):
    pytest.importorskip("tinker")
    import tinker
    from tinker import types

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with LiveServer(api.app) as base, StandInRunner(api.database_url) as runner, \
            tinker.ServiceClient(base_url=base, api_key=f"tml-{_key(api.client)}") as client:
        training = client.create_lora_training_client(base_model=BASE, rank=8).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                            loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})] * 1100
        out = training.forward_backward(data, "cross_entropy").result()  # the SDK sends at most 1024 per chunk
        assert len(out.loss_fn_outputs) == 1100
        ran = [(seq, kind) for model, seq, kind in runner.ran if model == training.model_id]
        assert ran == [(0, "create_model"), (1, "forward_backward"), (2, "forward_backward")]


def test_a_held_poll_holds_no_admission_place(database_url, tmp_path):
    with running_api(database_url, tmp_path, **{**SETTINGS, "tinker_poll_hold_s": 3}, api_threads=1) as api:
        created = _create_model(api.client, _session(api.client)).json()
        held = threading.Thread(target=_retrieve, args=(api.client, created["request_id"]))
        held.start()
        time.sleep(0.3)
        started = time.monotonic()
        assert api.client.post("/api/v1/session_heartbeat", json={"session_id": "tsess_x"}).status_code == 404
        assert time.monotonic() - started < 2 and held.is_alive()  # answered while the poll is still held
        held.join()
