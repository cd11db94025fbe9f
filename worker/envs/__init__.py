"""Multi-turn environments: a sandboxed Python class or a remote HTTP server, behind one protocol.

``make_environment(spec)`` gives the job's Environment (worker/envs/protocol.py);
close it when the job ends, it may own a child process or a connection pool.
"""

from __future__ import annotations

from collections.abc import Mapping

from service.egress import EgressPolicy
from service.schemas.environments import EnvironmentSpec, HttpEnvironment, PythonEnvironment
from worker.envs.protocol import Environment, Observation, Outcome


def make_environment(spec: EnvironmentSpec, *, egress: EgressPolicy | None = None,
                     secrets: Mapping[str, str] | None = None) -> Environment:
    if isinstance(spec, PythonEnvironment):
        from worker.envs.python_env import PythonEnvironmentProcess

        return PythonEnvironmentProcess(spec)
    if isinstance(spec, HttpEnvironment):
        from worker.envs.http_env import HttpEnvironmentClient

        if egress is None:
            from service.settings import get_settings

            egress = EgressPolicy.from_setting(get_settings().egress_allow)
        secret = (secrets or {}).get(spec.auth_secret) if spec.auth_secret else None
        return HttpEnvironmentClient(spec, policy=egress, secret=secret)
    raise ValueError(f"unknown environment type {getattr(spec, 'type', spec)!r}")


def describe_environment(spec: EnvironmentSpec | None) -> str:
    """How errors name the job's environment: its kind and class, or its URL."""
    if isinstance(spec, PythonEnvironment):
        return f"python environment (class {spec.class_name})"
    if isinstance(spec, HttpEnvironment):
        return f"http environment {spec.url}"
    return "environment"


__all__ = ["Environment", "Observation", "Outcome", "describe_environment", "make_environment"]
