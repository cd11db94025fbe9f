"""Registered reward functions: a named, validated reward spec a job may reference by id.

A job copies the spec into its own JobSpec when it is created, so a running
job never depends on the registered row; deleting one is still refused while
a live job references it, so the job's `reward_function` id stays meaningful.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.db.models import RewardFunction
from service.errors import InUse, NotFound
from service.repositories import jobs as jobs_repo
from service.repositories import reward_functions as rf_repo
from service.rewards.references import check_reward_references
from service.schemas.api import RewardFunctionCreate
from service.settings import Settings


def create(session: Session, project_id: str, body: RewardFunctionCreate, *,
           settings: Settings | None = None) -> RewardFunction:
    check_reward_references(session, project_id, body.spec, param="spec", settings=settings)
    return rf_repo.add(session, RewardFunction(project_id=project_id, name=body.name,
                                               spec=body.spec.model_dump(mode="json")))


def get(session: Session, project_id: str, fn_id: str) -> RewardFunction:
    fn = rf_repo.get(session, project_id, fn_id)
    if fn is None:
        raise NotFound(f"no such reward function: {fn_id}", param="reward_function_id")
    return fn


def delete(session: Session, project_id: str, fn_id: str) -> RewardFunction:
    fn = get(session, project_id, fn_id)
    if job_id := jobs_repo.live_job_uses(session, project_id, reward_function_id=fn_id):
        raise InUse("reward function", fn_id, job_id, param="reward_function_id")
    rf_repo.delete(session, fn)
    return fn
