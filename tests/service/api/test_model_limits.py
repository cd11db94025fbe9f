"""What a base model can be and take, known before any attempt: lengths past the model's positions (its
config.json) are refused naming the field, and a model no worker can fetch fails the dry run saying why instead
of passing as "skipped"."""

from __future__ import annotations

import json
import shutil

from tests.service.api.conftest import assert_error, cispo_body, running_api, uploaded
from tests.service.api.test_dry_run import checks, dry
from tests.conftest import free_port

JOBS = "/v1/fine_tuning/jobs"
ROWS = [{"prompt": "abc=", "answer": "c"}, {"prompt": "xy=", "answer": "y"}]
SAMPLING = "method.cispo.hyperparameters.sampling"


def _body(api, model: str, **sampling) -> dict:
    body = cispo_body(uploaded(api.client, ROWS), model=model)
    if sampling:
        body["method"]["cispo"]["hyperparameters"]["sampling"] = sampling
    return body


def test_lengths_past_the_models_positions_are_refused_naming_the_field(api, toy_dir):
    model = str(toy_dir / "model")  # max_position_embeddings 256
    huge = _body(api, model, max_model_len=1_048_576, max_output_tokens=131_072)
    for response in (dry(api, huge), api.client.post(JOBS, json=huge)):
        error = assert_error(response, 400, f"{SAMPLING}.max_model_len: 1048576 is more than the 256 positions")
        assert error["param"] == f"{SAMPLING}.max_model_len"
    error = assert_error(api.client.post(JOBS, json=_body(api, model, max_output_tokens=300)), 400,
                         "max_output_tokens: 300 leaves no room for a prompt in the 256 positions")
    assert error["param"] == f"{SAMPLING}.max_output_tokens"
    assert api.enqueued.ids == []  # nothing was queued
    # Within the model: accepted, and the dry run says so.
    found = checks(dry(api, _body(api, model, max_model_len=256, max_output_tokens=64)))
    assert [c["status"] for c in found["lengths"]] == ["passed"]
    # The defaults (1024, 256) are no user's doing: a warning that says what to set, not a claim that all fits.
    [lengths] = [c for c in checks(dry(api, _body(api, model)))["lengths"] if c["param"].endswith("max_model_len")]
    assert lengths["status"] == "warning" and "more than the 256 positions" in lengths["message"]


def test_an_eval_with_lengths_past_the_models_positions_is_refused(api, toy_dir):
    body = {"model": str(toy_dir / "model"), "file": uploaded(api.client, ROWS),
            "reward": {"type": "exact_match", "field": "answer"},
            "sampling": {"max_model_len": 1_048_576, "max_output_tokens": 131_072}}
    error = assert_error(api.client.post("/v1/evals", json=body), 400,
                         "sampling.max_model_len: 1048576 is more than the 256 positions")
    assert error["param"] == "sampling.max_model_len"


def test_a_cached_hub_models_config_bounds_its_lengths(database_url, toy_dir, tmp_path):
    cache = tmp_path / "hf-cache"
    snapshot = cache / "models--org--tiny" / "snapshots" / "0123abc"
    shutil.copytree(toy_dir / "model", snapshot)
    with running_api(database_url, tmp_path, hf_hub_cache=cache, hf_hub_offline=True) as api:
        error = assert_error(api.client.post(JOBS, json=_body(api, "org/tiny", max_model_len=4096)), 400,
                             "4096 is more than the 256 positions")
        assert error["param"] == f"{SAMPLING}.max_model_len"
        [model] = checks(dry(api, _body(api, "org/tiny", max_model_len=256, max_output_tokens=8)))["model"]
        assert model["status"] == "passed" and "in the model cache: LlamaForCausalLM" in model["message"]


def test_a_model_no_worker_can_fetch_fails_the_dry_run_saying_why(database_url, tmp_path):
    for settings, why in (({"hf_hub_offline": True}, "the workers download nothing (HF_HUB_OFFLINE)"),):
        with running_api(database_url, tmp_path / str(len(why)), hf_hub_cache=tmp_path / "empty-cache",
                         **settings) as api:
            for model in ("Qwen/NoSuchModel-7B", "models/tiny"):
                error = assert_error(dry(api, _body(api, model)), 400, f"model: '{model}' is not in the model cache",
                                     why, "a relative path such as 'models/tiny' is read as a hub id")
                assert error["param"] == "model"
            if "HF_HUB_OFFLINE" in why:  # then creating the job is refused too: nothing is queued
                error = assert_error(api.client.post(JOBS, json=_body(api, model)), 400, "no worker can load it")
                assert error["param"] == "model" and error["code"] == "model_not_found" and api.enqueued.ids == []
    # No hub configured to ask, or one that does not answer: not a pass and not "skipped", a warning that says
    # what was not checked (an outage says nothing of the model).
    gone_hub = f"http://127.0.0.1:{free_port()}"
    for name, settings in (("none", {}), ("gone", {"model_hub_url": gone_hub})):
        with running_api(database_url, tmp_path / name, hf_hub_cache=tmp_path / "empty-cache", **settings) as api:
            [model] = checks(dry(api, _body(api, "Qwen/NoSuchModel-7B")))["model"]
            assert model["status"] == "warning" and "fails (invalid_job) if no worker can download it" in \
                model["message"]
            assert name == "none" or f"the hub ({gone_hub}) did not answer" in model["message"]
