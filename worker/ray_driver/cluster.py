"""The driver's hold on the Ray cluster: connect, reserve the job's gang, give everything back."""

from __future__ import annotations

import logging
import time

from worker.ray_driver.errors import GangUnavailable

# Ray is imported in each function: the package imports (and its pure parts test) where the extra is absent.

log = logging.getLogger(__name__)
NAMESPACE = "cispo"


def connect(address: str) -> None:
    """Join the cluster as a driver (once per worker process; a later job reuses the connection)."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)


def uses_gpus() -> bool:
    """Whether the cluster has GPUs: then each rank takes one; without, each takes one CPU (gloo)."""
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def bundles(nodes: int, per_node: int, gpus: bool) -> list[dict[str, float]]:
    """One bundle per node holding all its ranks: with STRICT_SPREAD, `nodes` distinct machines."""
    return [{"CPU": float(per_node), **({"GPU": float(per_node)} if gpus else {})} for _ in range(nodes)]


def reserve(nodes: int, per_node: int, gpus: bool, timeout_s: float, name: str, should_stop=lambda: False,
            sampler: bool = False) -> list | None:
    """The job's placement groups, all granted (gang) within timeout_s, or GangUnavailable (nothing held): the
    ranks' (one bundle per node), then with `sampler` the sampler actor's own (one GPU, or one CPU, on any node:
    a group of its own because the ranks' STRICT_SPREAD would want a further node for it).
    None when `should_stop` says so first (a cancel, pause or drain while the job waits for its nodes)."""
    import ray
    from ray.util.placement_group import placement_group

    groups = [placement_group(bundles(nodes, per_node, gpus), strategy="STRICT_SPREAD" if nodes > 1 else
                              "STRICT_PACK", name=name)]
    if sampler:
        groups.append(placement_group(bundles(1, 1, gpus), strategy="STRICT_PACK", name=f"{name}-sampler"))
    ready, deadline = [g.ready() for g in groups], time.monotonic() + timeout_s
    while True:
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        if len(done) == len(ready):
            return groups
        if should_stop():
            release(groups, [])
            return None
        if time.monotonic() >= deadline:
            release(groups, [])
            unit = "GPU" if gpus else "CPU"
            also = f" and 1 {unit} for the sampler" if sampler else ""
            raise GangUnavailable(f"the Ray cluster did not grant {nodes} node(s) x {per_node} {unit}(s){also} at "
                                  f"once within {timeout_s:.0f} s (it has {_free()})")


def _free() -> str:
    import ray

    free = ray.available_resources()
    return ", ".join(f"{free.get(k, 0):g} {k} free" for k in ("GPU", "CPU")) + f" on {len(alive_nodes())} node(s)"


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def release(groups: list, actors: list, others: list = ()) -> None:
    """Kill every actor (ranks, the sampler, helpers such as the channel's queues), then free the placement
    groups."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in [*actors, *others]:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            log.debug("actor already gone", exc_info=True)
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:
            log.warning("could not remove the placement group", exc_info=True)
