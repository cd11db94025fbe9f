"""The optional Ray cluster on paper: the chart's KubeRay RayCluster, the workers' CISPO_RAY_ADDRESS, the
values schema, and docker-compose's `ray` profile (parsed, never run)."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest

from tests.deploy.test_manifests import (TEMPLATES, chart_values, compose_services, define_body, expressions, one,
                                         service_env, values_schema)


def _ray_pods(doc: dict) -> dict[str, dict]:
    spec = doc["spec"]
    groups = {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}
    return {name: g["template"]["spec"] for name, g in groups.items()}


def test_the_raycluster_has_a_head_without_gpus_and_a_gpu_group_sized_by_values():
    _, doc, table = one("RayCluster", "ray")
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"  # no rank lands on the head
    pods = _ray_pods(doc)
    assert set(pods) == {"head", "gpu"}
    head_ports = {p["containerPort"] for p in pods["head"]["containers"][0]["ports"]}
    assert 10001 in head_ports  # Ray Client: how the workers drive jobs
    (gpu_group,) = doc["spec"]["workerGroupSpecs"]
    values = chart_values()["ray"]["gpuWorkers"]
    assert gpu_group["rayStartParams"]["num-gpus"] == str(values["gpusPerNode"])
    assert gpu_group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == \
        values["gpusPerNode"]
    for pod in pods.values():
        image = pod["containers"][0]["image"]
        assert any(".Values.worker.image" in e and ".Values.ray.image" in e for e in expressions(image, table))


def test_ray_pods_read_the_config_but_never_the_secret():
    _, doc, table = one("RayCluster", "ray")
    for name, pod in _ray_pods(doc).items():
        for container in pod["containers"]:
            refs = container.get("envFrom") or []
            assert not [r for r in refs if "secretRef" in r], f"{name} reads the Secret"
            assert "env" not in container or not [e for e in container["env"] if "secretKeyRef" in str(e)]
    # rank 0 scores rewards in its sandbox: the GPU pods take the worker's contexts (the include lines)
    gpu_group = (TEMPLATES / "raycluster.yaml").read_text().split("workerGroupSpecs:", 1)[1]
    assert 'include "cispo.workerPodSecurityContext"' in gpu_group
    assert 'include "cispo.workerContainerSecurityContext"' in gpu_group


def test_workers_get_the_ray_address_of_the_chart_s_cluster_or_the_operator_s():
    config = define_body("cispo.config")
    assert re.search(r'^CISPO_RAY_ADDRESS:\s*\{\{\s*include "cispo.rayAddress"', config, re.M)
    assert re.search(r"^CISPO_RAY_GANG_TIMEOUT_S:\s*\{\{\s*\.Values\.ray\.gangTimeoutS", config, re.M)
    address = define_body("cispo.rayAddress")
    assert ".Values.ray.address" in address and "ray://%s-head-svc:10001" in address  # KubeRay's head Service
    assert 'dict "ctx" . "component" "ray"' in address  # the RayCluster's own name
    values = chart_values()["ray"]
    assert values["enabled"] is False and values["address"] == ""  # off unless asked for


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda r: r.update(enabled="yes"), id="enabled-not-boolean"),
    pytest.param(lambda r: r["gpuWorkers"].update(gpusPerNode=0), id="no-gpus-per-node"),
    pytest.param(lambda r: r["gpuWorkers"]["resources"]["limits"].update({"nvidia.com/gpu": 8}), id="gpu-limit-twice"),
    pytest.param(lambda r: r.update(gangTimeoutS=0), id="no-gang-wait"),
    pytest.param(lambda r: r.update(rayVersion="latest"), id="ray-version-not-a-version"),
    pytest.param(lambda r: r.update(objectStore={}), id="unknown-key"),
])
def test_the_schema_refuses_wrong_ray_values(mutate):
    values = copy.deepcopy(chart_values())
    mutate(values["ray"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(values_schema()).validate(values)
    enabled = copy.deepcopy(chart_values())
    enabled["ray"].update(enabled=True, image={"repository": "r/cispo-worker", "tag": "1", "pullPolicy": "Always"})
    jsonschema.Draft7Validator(values_schema()).validate(enabled)


def test_compose_ray_profile_is_optional_and_the_workers_can_be_pointed_at_it():
    services = compose_services()
    assert services["ray-head"]["profiles"] == services["ray-node"]["profiles"] == ["ray"]
    head = services["ray-head"]["command"]
    assert head[:3] == ["ray", "start", "--head"] and "--ray-client-server-port=10001" in head
    assert "--num-gpus=0" in head and "--block" in head
    assert services["ray-node"]["command"] == ["ray", "start", "--address=ray-head:6379", "--block"]
    for name in ("api", "worker"):  # empty unless .env says ray://ray-head:10001
        assert service_env(services[name])["CISPO_RAY_ADDRESS"] in ("", None)
    node_env = service_env(services["ray-node"])
    assert not {"DATABASE_URL", "STORAGE_URL", "AWS_SECRET_ACCESS_KEY"} & set(node_env)  # no credentials
