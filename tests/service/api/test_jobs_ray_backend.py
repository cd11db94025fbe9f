"""Jobs larger than one machine: resources.nodes and resources.backend are refused (400 naming the field) on
a deployment without a Ray cluster, and accepted (spec as sent) on one that names it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.job_spec.backend import ray_refusal
from service.settings import Settings
from tests.service.api.conftest import assert_error, cispo_body, running_api, uploaded
from tests.specs import job_spec

JOBS = "/v1/fine_tuning/jobs"
HP = "method.cispo.hyperparameters"
ONE_STEP = {"steps": 1, "batch_size": 4, "group_size": 2, "mini_batches": 1}  # 4 prompts: one per rank of 2 nodes x 2 GPUs


def _body(api, **resources):
    body = cispo_body(uploaded(api.client))
    body["method"]["cispo"]["hyperparameters"]["resources"] = resources
    return body


def test_nodes_and_ray_backend_are_refused_without_a_ray_cluster(api):
    error = assert_error(api.client.post(JOBS, json=_body(api, nodes=2)), 400, "resources.nodes is 2",
                         "CISPO_RAY_ADDRESS")
    assert error["param"] == f"{HP}.resources.nodes" and error["code"] == "backend_unavailable"
    error = assert_error(api.client.post(JOBS, json=_body(api, backend="ray")), 400, "CISPO_RAY_ADDRESS")
    assert error["param"] == f"{HP}.resources.backend"
    # the dry run says so too; a one-node local job is untouched
    assert_error(api.client.post(JOBS, params={"dry_run": "true"}, json=_body(api, nodes=2)), 400, "nodes")
    assert api.client.post(JOBS, json=_body(api, nodes=1, backend="local")).status_code == 200
    assert_error(api.client.post(JOBS, json=_body(api, backend="slurm")), 400, f"{HP}.resources.backend")
    assert_error(api.client.post(JOBS, json=_body(api, nodes=0)), 400, f"{HP}.resources.nodes")


def test_a_deployment_with_a_ray_cluster_takes_the_job(database_url, tmp_path):
    """The API does not import Ray (its image ships without it): the cluster's address is the operator's word."""
    with running_api(database_url, tmp_path, ray_address="ray-head:6379") as api:
        r = api.client.post(JOBS, json=_body(api, nodes=2, gpus=1))
        assert r.status_code == 200, r.text
        assert api.enqueued.ids == [r.json()["id"]]
        spec = api.client.post(JOBS, params={"dry_run": "true"}, json=_body(api, nodes=2)).json()["spec"]
        assert spec["resources"] == {"gpus": 1, "nodes": 2, "backend": "local"}
        # asynchronous rollouts too: the sampler runs as a Ray actor of its own (worker/ray_driver/sampler_actor.py)
        body = _body(api, nodes=2)
        body["method"]["cispo"]["hyperparameters"]["rollout"] = {"max_staleness": 1}
        r = api.client.post(JOBS, params={"dry_run": "true"}, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["spec"]["rollout"]["max_staleness"] == 1


def test_a_worker_without_the_ray_package_refuses_the_job_naming_the_package():
    spec = job_spec(training=ONE_STEP, resources={"nodes": 2})
    field, why = ray_refusal(spec, Settings(ray_address="head:6379"), installed=False)
    assert field == "resources.nodes" and "`ray`" in why
    assert ray_refusal(spec, Settings(ray_address="head:6379"), installed=True) is None
    assert ray_refusal(spec, Settings(ray_address="head:6379")) is None  # the API: not its package to check
    local = job_spec(training=ONE_STEP)
    assert ray_refusal(local, Settings(), installed=False) is None


def test_the_world_size_is_nodes_times_gpus():
    spec = job_spec(training=ONE_STEP, resources={"nodes": 2, "gpus": 2})
    assert spec.resources.processes == 4 and spec.resources.on_ray
    with pytest.raises(ValidationError, match=r"resources.nodes x resources.gpus \(4\) must divide"):
        job_spec(training={**ONE_STEP, "batch_size": 2}, resources={"nodes": 2, "gpus": 2})


def test_vllm_on_ray_runs_in_the_sampler_actor_of_asynchronous_rollouts():
    """vLLM on Ray samples in the sampler actor (worker/ray_driver/sampler_actor.py), which only an asynchronous
    job starts: a synchronous one is refused naming rollout.max_staleness."""
    for resources in ({"backend": "ray"}, {"nodes": 2}):
        with pytest.raises(ValidationError, match="rollout.max_staleness is 0: set rollout.max_staleness to 1"):
            job_spec(training=ONE_STEP, rollout={"engine": "vllm"}, resources=resources)
        spec = job_spec(training=ONE_STEP, rollout={"engine": "vllm", "max_staleness": 1},
                        resources=resources)
        assert spec.rollout.engine == "vllm" and spec.resources.on_ray
    # On one node, FSDP ranks still have no vLLM of their own (the sampler process is not given it there).
    with pytest.raises(ValidationError, match="rollout.engine 'vllm' runs in one training process"):
        job_spec(training=ONE_STEP, rollout={"engine": "vllm", "max_staleness": 1}, resources={"gpus": 2})
