"""Which jobs share a resident base, and which run alone and say why."""

from __future__ import annotations

import pytest

from service.job_spec.spec import JobSpec
from tests.specs import merged
from worker.multi.support import base_key, refusal
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
    """Full fine-tuning (every weight is the job's own: there is no base to share), a quantised base and several
    GPUs; a different base, dtype or rollout.dtype is another shared worker's (base_key)."""
    raw = merged(toy_spec(toy_dir), {"lora": {"base_quantization": "nf4"}, "rollout": {"dtype": "bfloat16"}})
    assert refusal(JobSpec.model_validate(raw)) == "its base is quantised"
    raw = merged(toy_spec(toy_dir), {"rollout": {"max_staleness": 1}, "resources": {"gpus": 2}})
    assert refusal(JobSpec.model_validate(raw)) == "it runs on several GPUs"


def test_jobs_share_a_base_only_with_jobs_of_their_dtype_and_rollout_dtype(toy_dir):
    """A job sampling in its own rollout.dtype shares a base with jobs that sample in that dtype and train in its
    dtype (one decode, on one set of cast weights); a rollout.dtype that is the training dtype is no other."""
    def key(**sections):
        return base_key(JobSpec.model_validate(merged(toy_spec(toy_dir), sections)))

    plain = key(dtype="float32")
    bf16 = key(dtype="float32", rollout={"dtype": "bfloat16"})
    assert bf16 != plain and bf16 == key(dtype="float32", rollout={"dtype": "bfloat16", "max_staleness": 1})
    assert bf16[:2] == plain[:2]  # the same model, held in the same precision
    assert key(dtype="float32", rollout={"dtype": "float32"}) == plain
    assert key(dtype="bfloat16", rollout={"dtype": "bfloat16"}) == key(dtype="bfloat16") != bf16
    assert key(dtype="float32", rollout={"dtype": "float16"}) not in (plain, bf16)


# Each trained on the shared base as alone (tests/worker/multi/test_resident_jobs.py's option test).
@pytest.mark.parametrize("sections", [
    {"training": {"gradient_checkpointing": True}},
    {"training": {"pack_tokens": 64}},
    {"training": {"lm_head_float32": True}},
    {"init_from": "/checkpoints/step-00000010"},  # continuing an `ft:` model: the worker passes its local copy
    {"method": "supervised"},
    {"rollout": {"max_staleness": 1, "version_policy": "fixed_lag"}},  # a stale sampling copy of its adapter
    {"rollout": {"max_staleness": 2}},  # 'newest': sampled as 'fixed_lag' is (worker/multi/job.py)
    {"rollout": {"dtype": "bfloat16"}},  # decoded on bfloat16 copies of the base's weights, as alone
], ids=["gradient_checkpointing", "pack_tokens", "lm_head_float32", "init_from", "supervised", "async",
        "async_newest", "rollout_dtype"])
def test_jobs_with_these_options_share_a_base(toy_dir, sections):
    assert refusal(JobSpec.model_validate(merged(toy_spec(toy_dir), sections))) is None
