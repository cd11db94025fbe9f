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


# Each trained on the shared base as alone (tests/worker/multi/test_resident_jobs.py's option test).
@pytest.mark.parametrize("sections", [
    {"training": {"gradient_checkpointing": True}},
    {"training": {"pack_tokens": 64}},
    {"training": {"lm_head_float32": True}},
    {"init_from": "/checkpoints/step-00000010"},  # continuing an `ft:` model: the worker passes its local copy
], ids=["gradient_checkpointing", "pack_tokens", "lm_head_float32", "init_from"])
def test_jobs_with_these_options_share_a_base(toy_dir, sections):
    assert refusal(JobSpec.model_validate(merged(toy_spec(toy_dir), sections))) is None
