"""JobSpec validation: defaults, and errors that name the offending field."""

from __future__ import annotations

import warnings

import pytest
from pydantic import ValidationError

from service.job_spec.objective import ConstantSchedule, CosineSchedule
from service.job_spec.spec import JobSpec
from tests.specs import job_spec, spec_fields


def _errors(**overrides) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        job_spec(**overrides)
    return info.value.errors()


def test_minimal_spec_gets_defaults():
    """A minimal spec validates and is filled with the documented defaults."""
    job = job_spec()
    assert job.model == "org/tiny-model"
    assert job.data.train_file == "train.jsonl"
    assert job.reward.path == "pkg.mod:fn"
    assert job.loss.ratio_max == 5.0
    assert job.loss.normalization == "token"
    assert job.loss.kl_beta == 0.0
    assert job.training.mini_batches == 4
    assert job.optimizer.betas == (0.9, 0.95)
    assert job.advantages.scale == "none"
    assert isinstance(job.schedule, ConstantSchedule)


@pytest.mark.parametrize("missing", ["model", "data"])
def test_required_fields(missing):
    """model and data have no default; the error's loc names the missing one."""
    spec = spec_fields()
    del spec[missing]
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(spec)
    assert [(e["type"], e["loc"]) for e in info.value.errors()] == [("missing", (missing,))]


def test_group_size_one_names_the_field():
    """group_size 1 is refused and the error's loc points at training.group_size."""
    errors = _errors(training={"group_size": 1})
    assert len(errors) == 1
    assert errors[0]["loc"] == ("training", "group_size")
    assert errors[0]["type"] == "greater_than_equal"


@pytest.mark.parametrize("out_tokens", [1024, 2048])
def test_max_output_tokens_must_be_below_max_model_len(out_tokens):
    """max_output_tokens >= max_model_len is refused with a message naming both fields."""
    errors = _errors(sampling={"max_output_tokens": out_tokens, "max_model_len": 1024})
    assert len(errors) == 1
    assert errors[0]["loc"] == ("sampling",)
    assert "max_output_tokens" in errors[0]["msg"] and "max_model_len" in errors[0]["msg"]


def test_max_output_tokens_just_below_max_model_len_accepted():
    """One token of room for the prompt is enough."""
    job = job_spec(sampling={"max_output_tokens": 1023, "max_model_len": 1024})
    assert job.sampling.max_output_tokens == 1023


@pytest.mark.parametrize(
    "overrides,loc",
    [
        ({"learning_rate": 1e-5}, ("learning_rate",)),
        ({"training": {"batchsize": 4}}, ("training", "batchsize")),
        ({"loss": {"ratio_min": 0.8}}, ("loss", "ratio_min")),
    ],
)
def test_unknown_field_refused(overrides, loc):
    """Unknown fields, top-level or nested, are refused as extra_forbidden with their name in loc."""
    errors = _errors(**overrides)
    assert [(e["type"], e["loc"]) for e in errors] == [("extra_forbidden", loc)]


def test_ratio_max_below_one_refused():
    """ratio_max 0.5 is refused at loss.ratio_max."""
    errors = _errors(loss={"ratio_max": 0.5})
    assert [(e["type"], e["loc"]) for e in errors] == [("greater_than_equal", ("loss", "ratio_max"))]


def test_low_ratio_max_accepted_with_warning():
    """ratio_max 1.5 is allowed but warns that the cap will bind on most off-policy tokens."""
    with pytest.warns(UserWarning, match="ratio_max=1.5"):
        job = job_spec(loss={"ratio_max": 1.5})
    assert job.loss.ratio_max == 1.5


def test_usual_ratio_max_does_not_warn():
    """ratio_max in the recommended range validates silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job = job_spec(loss={"ratio_max": 4.0})
    assert job.loss.ratio_max == 4.0


def test_schedule_union_picks_cosine():
    """type: cosine selects CosineSchedule with its own knobs."""
    job = job_spec(schedule={"type": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1})
    assert isinstance(job.schedule, CosineSchedule)
    assert (job.schedule.warmup_steps, job.schedule.min_lr_ratio) == (10, 0.1)


def test_schedule_union_rejects_other_variants_knobs_and_unknown_type():
    """A cosine knob on a constant schedule, or an unknown type, is refused under schedule."""
    errors = _errors(schedule={"type": "constant", "min_lr_ratio": 0.1})
    assert [(e["type"], e["loc"]) for e in errors] == [("extra_forbidden", ("schedule", "constant", "min_lr_ratio"))]
    errors = _errors(schedule={"type": "linear"})
    assert [(e["type"], e["loc"]) for e in errors] == [("union_tag_invalid", ("schedule",))]


def test_mini_batches_larger_than_sequences_refused():
    """mini_batches > batch_size * group_size is refused with a message naming mini_batches."""
    errors = _errors(training={"batch_size": 1, "group_size": 2, "mini_batches": 3})
    assert len(errors) == 1
    assert errors[0]["loc"] == ("training",)
    assert "mini_batches (3)" in errors[0]["msg"]
    job = job_spec(training={"batch_size": 1, "group_size": 2, "mini_batches": 2})
    assert job.training.mini_batches == 2


def test_reward_path_must_be_module_colon_function():
    """reward.path without ':function' is refused at reward.import.path."""
    errors = _errors(reward={"type": "import", "path": "pkg.mod"})
    assert [(e["type"], e["loc"]) for e in errors] == [("string_pattern_mismatch", ("reward", "import", "path"))]


def test_exactly_one_of_reward_or_environment():
    """Neither or both is refused with a message naming both fields; an environment alone is a valid job."""
    env = {"type": "http", "url": "https://env.example.com/api/"}
    spec = spec_fields()
    del spec["reward"]
    with pytest.raises(ValidationError, match="exactly one of reward .* or environment"):
        JobSpec.model_validate(spec)
    with pytest.raises(ValidationError, match="exactly one of reward .* or environment"):
        job_spec(environment=env)
    job = JobSpec.model_validate({**spec, "environment": env, "training": {"max_turns": 8},
                                  "advantages": {"per_turn": True}})
    assert job.reward is None and job.environment.url == "https://env.example.com/api"
    assert job.training.max_turns == 8 and job.advantages.per_turn


def test_max_turns_bounds_and_reward_jobs_are_single_turn():
    assert _errors(training={"max_turns": 65})[0]["loc"] == ("training", "max_turns")
    assert _errors(training={"max_turns": 0})[0]["loc"] == ("training", "max_turns")
    with pytest.raises(ValidationError, match="max_turns is 2, but a reward function scores a single turn"):
        job_spec(training={"max_turns": 2})


def test_rollout_defaults_to_transformers_with_tis_on():
    """Without a rollout section the job samples with transformers; the TIS cap waits for an engine's log-probs."""
    job = job_spec()
    assert job.rollout.engine == "hf"
    assert job.rollout.tis_cap == 2.0
    assert job.rollout.gpu_memory_utilization == 0.3
    vllm = job_spec(rollout={"engine": "vllm", "gpu_memory_utilization": 0.5, "tis_cap": None})
    assert (vllm.rollout.engine, vllm.rollout.gpu_memory_utilization, vllm.rollout.tis_cap) == ("vllm", 0.5, None)


@pytest.mark.parametrize(
    "rollout,loc,kind",
    [
        ({"engine": "sglang"}, ("rollout", "engine"), "literal_error"),
        ({"gpu_memory_utilization": 0.0}, ("rollout", "gpu_memory_utilization"), "greater_than"),
        ({"gpu_memory_utilization": 0.99}, ("rollout", "gpu_memory_utilization"), "less_than_equal"),
        ({"tis_cap": -1.0}, ("rollout", "tis_cap"), "greater_than_equal"),
        ({"tensor_parallel": 2}, ("rollout", "tensor_parallel"), "extra_forbidden"),
    ],
)
def test_rollout_bad_values_name_the_field(rollout, loc, kind):
    """Unknown engines, out-of-range knobs and unknown fields are refused at their own loc."""
    assert [(e["type"], e["loc"]) for e in _errors(rollout=rollout)] == [(kind, loc)]


@pytest.mark.parametrize("cap", [0.0, 1.0, 3.0])
def test_rollout_tis_cap_zero_disables_and_one_or_more_accepted(cap):
    assert job_spec(rollout={"tis_cap": cap}).rollout.tis_cap == cap


def test_rollout_tis_cap_below_one_refused():
    """A cap in (0, 1) would shrink every token; the message names tis_cap."""
    errors = _errors(rollout={"tis_cap": 0.5})
    assert len(errors) == 1 and errors[0]["loc"] == ("rollout",)
    assert "tis_cap" in errors[0]["msg"]


def test_float16_training_is_refused_but_float16_sampling_is_not():
    errors = _errors(dtype="float16")
    assert errors[0]["loc"] == ("dtype",) and "loss scaling" in errors[0]["msg"]
    assert job_spec(dtype="bfloat16", rollout={"dtype": "float16"}).rollout.dtype == "float16"
