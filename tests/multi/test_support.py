"""Which jobs share a resident base: multi-turn (environment) jobs do not today (their environment's reset and step
calls cannot run twice, as the shared rollout runs a job's generate()); they run alone, and say so."""

from __future__ import annotations

from service.job_spec.spec import JobSpec
from worker.multi.support import refusal
from worker.toy.__main__ import toy_spec
from worker.toy.two_turn import environment_spec


def test_a_single_turn_lora_job_shares_and_an_environment_job_does_not(toy_dir):
    raw = toy_spec(toy_dir)
    assert refusal(JobSpec.model_validate(raw)) is None
    raw.pop("reward")
    raw["environment"] = environment_spec()
    assert refusal(JobSpec.model_validate(raw)) == "it has a multi-turn environment"
