"""Can this deployment run the job where it asks to run? The check at create, without importing Ray.

A job with resources.nodes above 1, or resources.backend 'ray', is driven by
the claiming worker on the operator's Ray cluster (worker/ray_driver/). The
deployment must name that cluster (CISPO_RAY_ADDRESS): without it the job is
refused at create (400 naming the field). The `ray` package is the workers'
(the API image ships without it, as without torch): a worker lacking it fails
such a job at once (invalid_job naming the field, no retry).
"""

from __future__ import annotations

import importlib.util

from service.errors import InvalidRequest
from service.job_spec.spec import JobSpec
from service.settings import Settings


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def ray_refusal(spec: JobSpec, settings: Settings, *, installed: bool | None = None) -> tuple[str, str] | None:
    """(field, why) when the job needs Ray and this deployment has none; None when it can run. `installed`:
    whether the ray package is there (the worker says; None: not checked, as in the API)."""
    resources = spec.resources
    if not resources.on_ray:
        return None
    field = "resources.nodes" if resources.nodes > 1 else "resources.backend"
    asked = f"resources.nodes is {resources.nodes}" if resources.nodes > 1 else "resources.backend is 'ray'"
    if not settings.ray_address:
        return field, (f"{asked}, which runs on a Ray cluster, but this deployment has none (the operator sets "
                       "CISPO_RAY_ADDRESS): use nodes 1 and backend 'local'")
    if installed is False:
        return field, (f"{asked}, which runs on a Ray cluster, but this deployment lacks the `ray` package "
                       "(the operator installs the `ray` extra): use nodes 1 and backend 'local'")
    return None


def check_backend(spec: JobSpec, settings: Settings, *, where: str) -> None:
    """Raise InvalidRequest naming `where`.resources.<field> when the job cannot run on this deployment."""
    refusal = ray_refusal(spec, settings)
    if refusal is not None:
        field, why = refusal
        param = f"{where}.{field}" if where else field
        raise InvalidRequest(f"{param}: {why}", param=param, code="backend_unavailable")
