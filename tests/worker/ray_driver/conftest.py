"""A real two-node Ray cluster on this machine (ray.cluster_utils.Cluster): one CPU per node, a small object
store, no dashboard. Every test here skips when the `ray` extra is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}


@pytest.fixture(scope="module")
def two_nodes():
    """The cluster (head + one worker node), with this process connected to it as a driver."""
    yield from _cluster(NODE)


@pytest.fixture(scope="module")
def two_roomy_nodes():
    """two_nodes with two CPUs each: room for an asynchronous job's sampler actor beside its two ranks."""
    yield from _cluster({**NODE, "num_cpus": 2})


def _cluster(node: dict):
    ray = pytest.importorskip("ray")  # here, not at import: a conftest cannot skip itself
    from ray.cluster_utils import Cluster

    # The nodes' worker processes import this checkout, one thread each (the machine is small).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="cispo", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def pids_alive(pids) -> list[int]:
    """Those of `pids` still running (a zombie has exited)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive
