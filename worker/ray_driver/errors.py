"""The Ray cluster's failures, which say nothing about the job (imported without Ray)."""

from __future__ import annotations

RAY_CAPACITY = "ray_capacity"  # the error code of a run the cluster could not carry


class RayCapacity(RuntimeError):
    """The cluster cannot carry the job now: it runs again later from its newest checkpoint, using no attempt."""


class GangUnavailable(RayCapacity):
    """The placement group (every rank's GPUs at once) was not granted within the gang timeout."""


class NodeLost(RayCapacity):
    """A node that held a rank left the cluster mid-run."""
