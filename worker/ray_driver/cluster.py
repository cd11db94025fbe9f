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


def reserve(nodes: int, per_node: int, gpus: bool, timeout_s: float, name: str, should_stop=lambda: False):
    """The job's placement group, granted whole (gang) within timeout_s, or GangUnavailable (nothing held);
    None when `should_stop` says so first (a cancel, pause or drain while the job waits for its nodes)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    wanted = bundles(nodes, per_node, gpus)
    group = placement_group(wanted, strategy="STRICT_SPREAD" if nodes > 1 else "STRICT_PACK", name=name)
    ready, deadline = group.ready(), time.monotonic() + timeout_s
    while True:
        try:
            ray.get(ready, timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            return group
        except ray.exceptions.GetTimeoutError:
            pass
        if should_stop():
            remove_placement_group(group)
            return None
        if time.monotonic() >= deadline:
            remove_placement_group(group)
            unit = "GPU" if gpus else "CPU"
            raise GangUnavailable(f"the Ray cluster did not grant {nodes} node(s) x {per_node} {unit}(s) at once "
                                  f"within {timeout_s:.0f} s (it has {_free()})")


def _free() -> str:
    import ray

    free = ray.available_resources()
    return ", ".join(f"{free.get(k, 0):g} {k} free" for k in ("GPU", "CPU")) + f" on {len(alive_nodes())} node(s)"


def alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def release(group, actors: list, others: list = ()) -> None:
    """Kill every rank actor (and helpers such as the channel's queues), then free the placement group."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in [*actors, *others]:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            log.debug("actor already gone", exc_info=True)
    if group is not None:
        try:
            remove_placement_group(group)
        except Exception:
            log.warning("could not remove the placement group", exc_info=True)
