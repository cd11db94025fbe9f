"""Registered environments: a named, validated environment spec a job may reference by id.

Like reward functions: a job copies the spec into its JobSpec when created,
so a running job never depends on the row; deleting one is still refused
while a live job uses it, so the job's `environment` id stays meaningful.

What a spec refers to outside itself is checked up front (fail fast, before
a job waits in the queue): the secret an http environment names must exist
in the project, and its URL must pass the egress policy. Python source is
only compiled and inspected with ast (service/schemas/environments.py); it
runs nowhere near this process. The worker checks again when the job starts.
"""

from __future__ import annotations

from pydantic import TypeAdapter
from sqlalchemy.orm import Session

from service.db.models import Environment
from service.egress import EgressPolicy, EgressRefused, check_url
from service.secrets.store import check_bindings
from service.errors import InUse, InvalidRequest, NotFound
from service.repositories import environments as env_repo
from service.schemas.environment_api import EnvironmentCreate
from service.schemas.environments import EnvironmentSpec, HttpEnvironment
from service.settings import Settings

_SPEC = TypeAdapter(EnvironmentSpec)


def check_references(session: Session, project_id: str, spec: EnvironmentSpec, *, param: str,
                     settings: Settings | None) -> None:
    """Raise InvalidRequest (naming ``param``) for a secret the project lacks or a URL egress refuses."""
    if not isinstance(spec, HttpEnvironment):
        return
    if spec.auth_secret:
        check_bindings(session, project_id, [(spec.auth_secret, spec.url)], param=f"{param}.auth_secret")
    if settings is None:
        return
    try:
        check_url(spec.url, EgressPolicy.from_setting(settings.egress_allow))
    except EgressRefused as e:
        raise InvalidRequest(f"{param}.url: {e}", param=f"{param}.url", code="egress_refused") from None


def create(session: Session, project_id: str, body: EnvironmentCreate, *,
           settings: Settings | None = None) -> Environment:
    check_references(session, project_id, body.spec, param="spec", settings=settings)
    return env_repo.add(session, Environment(project_id=project_id, name=body.name,
                                             spec=body.spec.model_dump(mode="json")))


def get(session: Session, project_id: str, env_id: str) -> Environment:
    env = env_repo.get(session, project_id, env_id)
    if env is None:
        raise NotFound(f"no such environment: {env_id}", param="environment_id")
    return env


def delete(session: Session, project_id: str, env_id: str) -> Environment:
    env = get(session, project_id, env_id)
    if job_id := env_repo.live_job_using(session, project_id, env_id):
        raise InUse("environment", env_id, job_id, param="environment_id")
    env_repo.delete(session, env)
    return env


def resolve_for_job(session: Session, project_id: str, ref: str | EnvironmentSpec, *, param: str,
                    settings: Settings | None) -> tuple[dict, str | None]:
    """(the spec as JSON, the registered id or None) for a job's `environment`: an id or an inline spec."""
    if isinstance(ref, str):
        env = env_repo.get(session, project_id, ref)
        if env is None:
            raise InvalidRequest(f"{param}: no such environment: {ref}", param=param, code="unknown_environment")
        spec, env_id = env.spec, env.id
    else:
        spec, env_id = ref.model_dump(mode="json"), None
    check_references(session, project_id, _SPEC.validate_python(spec), param=param, settings=settings)
    return spec, env_id
