"""The recipe knobs in the job spec: defaults that change nothing, and bad values refused at their own field."""

from __future__ import annotations

import pytest

from tests.service.job_spec.test_job_spec import _errors
from tests.specs import job_spec


def test_defaults_leave_every_knob_off():
    spec = job_spec()
    assert spec.advantages.scale == "none" and spec.loss.normalization == "token"
    assert spec.loss.importance_sampling_level == "token" and spec.loss.off_policy_mask is None
    assert spec.training.pass_rate_filter is None and spec.training.lm_head_float32 is False
    assert spec.sampling.min_output_tokens == 0 and spec.lora.base_quantization == "none"
    assert spec.training.pack_tokens is None


def test_enabled_knobs_take_the_recipes_defaults():
    spec = job_spec(loss={"off_policy_mask": {}, "normalization": "prompt",
                                              "importance_sampling_level": "sequence"},
                                        training={"pass_rate_filter": {}}, advantages={"scale": "batch_std"})
    assert spec.loss.off_policy_mask.token_bounds == (0.5, 5.0)  # AgileRL's band
    assert spec.loss.off_policy_mask.sequence_threshold is None
    assert spec.training.pass_rate_filter.threshold == 0.9  # ScaleRL's
    assert job_spec(loss={"off_policy_mask": {"token_bounds": None,
                                                                  "sequence_threshold": 0.03}})


@pytest.mark.parametrize(
    "overrides, loc, words",
    [
        ({"loss": {"normalization": "group"}}, ("loss", "normalization"), "token"),
        ({"loss": {"importance_sampling_level": "turn"}}, ("loss", "importance_sampling_level"), "sequence"),
        ({"loss": {"off_policy_mask": {"token_bounds": [2.0, 5.0]}}}, ("loss", "off_policy_mask"), "low < 1"),
        ({"loss": {"off_policy_mask": {"token_bounds": None}}}, ("loss", "off_policy_mask"), "sequence_threshold"),
        ({"loss": {"off_policy_mask": {"sequence_threshold": -1}}},
         ("loss", "off_policy_mask", "sequence_threshold"), "greater than 0"),
        ({"advantages": {"scale": "batch"}}, ("advantages", "scale"), "batch_std"),
        ({"training": {"pass_rate_filter": {"threshold": 1.5}}}, ("training", "pass_rate_filter", "threshold"),
         "less than or equal"),
        ({"training": {"pass_rate_filter": {"window": 3}}}, ("training", "pass_rate_filter", "window"), "Extra"),
        ({"sampling": {"min_output_tokens": 300}}, ("sampling",), "exceeds max_output_tokens"),
        ({"sampling": {"min_output_tokens": -1}}, ("sampling", "min_output_tokens"), "greater than or equal"),
        ({"lora": {"base_quantization": "int8"}}, ("lora", "base_quantization"), "nf4"),
        ({"lora": {"base_quantization": "nf4"}, "rollout": {"engine": "vllm"}}, (), "lora.base_quantization"),
        ({"training": {"lm_head_float32": True}, "resources": {"gpus": 2}}, (), "lm_head_float32"),
        ({"advantages": {"scale": "batch_std", "per_turn": True}}, (), "per_turn"),
        ({"training": {"pack_tokens": 1}}, ("training", "pack_tokens"), "greater than or equal to 2"),
        ({"training": {"pack_tokens": "lots"}}, ("training", "pack_tokens"), "integer"),
        ({"training": {"pack_tokens": 512}}, (), "training.pack_tokens (512) must be at least sampling.max_model_len"),
        ({"training": {"pack_tokens": 2048}, "method": "supervised", "reward": None}, (),
         "training.pack_tokens packs the CISPO update"),
    ],
)
def test_bad_values_name_the_field(overrides, loc, words):
    errors = _errors(**overrides)
    assert len(errors) == 1 and errors[0]["loc"] == loc, errors
    assert words in errors[0]["msg"], errors[0]["msg"]


def test_a_worker_without_bitsandbytes_refuses_qlora_naming_the_field(monkeypatch):
    """Before anything is loaded (invalid_job): the message names lora.base_quantization and what to do."""
    from worker.model import quantization

    monkeypatch.setattr(quantization, "bitsandbytes_installed", lambda: False)
    spec = job_spec(lora={"base_quantization": "nf4"})
    with pytest.raises(ValueError, match="lora.base_quantization is 'nf4'.*bitsandbytes is not installed"):
        quantization.refuse_unavailable_quantization(spec)
    quantization.refuse_unavailable_quantization(job_spec())  # no knob: nothing to refuse
    assert quantization.base_load_kwargs(job_spec(), None, None) == {}
