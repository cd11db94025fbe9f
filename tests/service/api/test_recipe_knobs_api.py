"""The recipe knobs over the API: bad values are refused naming the field; QLoRA without bitsandbytes is refused by
the dry run naming lora.base_quantization."""

from __future__ import annotations

import importlib.util

import pytest

from tests.service.api.conftest import assert_error, cispo_body, uploaded

JOBS = "/v1/fine_tuning/jobs"
HYPER = "method.cispo.hyperparameters"


def _with(api, section: str, values: dict, model: str = "tiny-model") -> dict:
    body = cispo_body(uploaded(api.client), model=model)
    body["method"]["cispo"]["hyperparameters"].setdefault(section, {}).update(values)
    return body


@pytest.mark.parametrize("section, values, field", [
    ("loss", {"normalization": "episode"}, f"{HYPER}.loss.normalization"),
    ("loss", {"importance_sampling_level": "turn"}, f"{HYPER}.loss.importance_sampling_level"),
    ("loss", {"off_policy_mask": {"token_bounds": [1.5, 5.0]}}, f"{HYPER}.loss.off_policy_mask"),
    ("advantages", {"scale": "batch"}, f"{HYPER}.advantages.scale"),
    ("training", {"pass_rate_filter": {"threshold": 0}}, f"{HYPER}.training.pass_rate_filter.threshold"),
    ("sampling", {"min_output_tokens": 999}, f"{HYPER}.sampling"),
    ("lora", {"base_quantization": "int4"}, f"{HYPER}.lora.base_quantization"),
    ("training", {"pack_tokens": 0}, f"{HYPER}.training.pack_tokens"),
])
def test_bad_knob_values_are_refused_naming_the_field(api, section, values, field):
    error = assert_error(api.client.post(JOBS, json=_with(api, section, values)), 400, field)
    assert error["param"] == field


def test_qlora_needs_bitsandbytes_and_the_dry_run_says_so(api, toy_dir):
    body = _with(api, "lora", {"base_quantization": "nf4"}, model=str(toy_dir / "model"))
    r = api.client.post(JOBS, params={"dry_run": "true"}, json=body)
    if importlib.util.find_spec("bitsandbytes") is None:  # this project does not install it
        error = assert_error(r, 400, "lora.base_quantization is 'nf4'", "bitsandbytes is not installed")
        assert error["param"] == f"{HYPER}.lora.base_quantization" and error["code"] == "dry_run_failed"
    else:
        assert r.status_code == 200 and any(c["name"] == "quantization" and c["status"] == "passed"
                                            for c in r.json()["checks"])
    # Without the knob the same job passes, and there is no quantization check at all.
    plain = api.client.post(JOBS, params={"dry_run": "true"}, json=_with(api, "lora", {}, model=str(toy_dir / "model")))
    assert plain.status_code == 200 and "quantization" not in {c["name"] for c in plain.json()["checks"]}


def test_a_packing_budget_below_the_model_length_is_refused_naming_both_fields(api):
    error = assert_error(api.client.post(JOBS, json=_with(api, "training", {"pack_tokens": 100})), 400,
                         "training.pack_tokens (100)", "sampling.max_model_len")
    assert error["param"] == "method.cispo"  # a cross-field rule: the message names both fields
