"""Which jobs share a resident base, and which run alone and say why."""

from __future__ import annotations

import pytest

from service.job_spec.spec import JobSpec
from tests.specs import merged
from worker.multi.support import refusal
from worker.toy.__main__ import toy_spec
from worker.toy.two_turn import environment_spec


def test_single_turn_and_environment_lora_jobs_share_and_others_say_why_not(toy_dir):
    raw = toy_spec(toy_dir)
    assert refusal(JobSpec.model_validate(raw)) is None
    raw.pop("reward")
    raw["environment"] = environment_spec()  # driven once per turn by the shared rollout (worker/multi/rollout.py)
    assert refusal(JobSpec.model_validate(raw)) is None
    raw["rollout"] = {"engine": "vllm"}  # the worker's one vLLM engine, an adapter slot per job
    assert refusal(JobSpec.model_validate(raw)) is None
    raw["lora"] = None
    assert refusal(JobSpec.model_validate(raw)) == "it fine-tunes every weight (lora: null)"


def test_what_still_runs_alone_says_why(toy_dir):
    """Full fine-tuning (every weight is the job's own: there is no base to share), a quantised base, its own
    sampling dtype and several GPUs; a different base or dtype is another shared worker's (base_key)."""
    raw = merged(toy_spec(toy_dir), {"lora": {"base_quantization": "nf4"}, "rollout": {"dtype": "bfloat16"}})
    assert refusal(JobSpec.model_validate(raw)) == "its base is quantised; it samples in its own rollout.dtype"
    raw = merged(toy_spec(toy_dir), {"rollout": {"max_staleness": 1}, "resources": {"gpus": 2}})
    assert refusal(JobSpec.model_validate(raw)) == "it runs on several GPUs"


# Each trained on the shared base as alone (tests/worker/multi/test_resident_jobs.py's option test).
@pytest.mark.parametrize("sections", [
    {"training": {"gradient_checkpointing": True}},
    {"training": {"pack_tokens": 64}},
    {"training": {"lm_head_float32": True}},
    {"init_from": "/checkpoints/step-00000010"},  # continuing an `ft:` model: the worker passes its local copy
    {"method": "supervised"},
    {"rollout": {"max_staleness": 1, "version_policy": "fixed_lag"}},  # a stale sampling copy of its adapter
    {"rollout": {"max_staleness": 2}},  # 'newest': sampled as 'fixed_lag' is (worker/multi/job.py)
], ids=["gradient_checkpointing", "pack_tokens", "lm_head_float32", "init_from", "supervised", "async",
        "async_newest"])
def test_jobs_with_these_options_share_a_base(toy_dir, sections):
    assert refusal(JobSpec.model_validate(merged(toy_spec(toy_dir), sections))) is None
