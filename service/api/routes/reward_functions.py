"""/v1/reward_functions (ours): register a reward spec once, reference it from many jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from service.api import presenters
from service.api.deps import PrincipalDep, SessionDep, SettingsDep
from service.api.scoring import score
from service.repositories import reward_functions as rf_repo
from service.rewards import registry as rf_service
from service.rewards import trials
from service.schemas.api import Deleted, ListObject, RewardFunctionCreate, RewardFunctionObject
from service.schemas.scoring_api import InlineRewardTestRequest, RewardTestObject, RewardTestRequest

router = APIRouter(prefix="/v1/reward_functions", tags=["reward functions"])


@router.post("", response_model=RewardFunctionObject)
def create_reward_function(body: RewardFunctionCreate, session: SessionDep, who: PrincipalDep,
                           settings: SettingsDep) -> RewardFunctionObject:
    row = rf_service.create(session, who.project_id, body, settings=settings)
    session.commit()
    return presenters.reward_function(row)


@router.get("", response_model=ListObject[RewardFunctionObject])
def list_reward_functions(session: SessionDep, who: PrincipalDep, after: str | None = None,
                          limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    rows = rf_repo.page(session, who.project_id, after=after, limit=limit)
    return presenters.page([presenters.reward_function(r) for r in rows.items], rows.has_more)


@router.get("/{reward_function_id}", response_model=RewardFunctionObject)
def get_reward_function(reward_function_id: str, session: SessionDep, who: PrincipalDep) -> RewardFunctionObject:
    return presenters.reward_function(rf_service.get(session, who.project_id, reward_function_id))


@router.delete("/{reward_function_id}", response_model=Deleted)
def delete_reward_function(reward_function_id: str, session: SessionDep, who: PrincipalDep) -> Deleted:
    row = rf_service.delete(session, who.project_id, reward_function_id)
    session.commit()
    return Deleted(id=row.id, object="reward_function")


@router.post("/test", response_model=RewardTestObject)
async def test_inline_reward(request: Request, body: InlineRewardTestRequest, session: SessionDep,
                             who: PrincipalDep, settings: SettingsDep) -> RewardTestObject:
    """Score samples with a reward spec that is not registered yet (same scoring as a job's)."""
    spec = body.spec.model_dump(mode="json")
    answer = await score(request, who.project_id, lambda: trials.prepare_reward_test(
        session, who.project_id, spec, body, settings=settings))
    return trials.reward_test_result(answer)


@router.post("/{reward_function_id}/test", response_model=RewardTestObject)
async def test_reward_function(request: Request, reward_function_id: str, body: RewardTestRequest,
                               session: SessionDep, who: PrincipalDep, settings: SettingsDep) -> RewardTestObject:
    """Score samples with a registered reward: scores, sub-scores, errors by kind, timing."""
    def prepare():
        fn = rf_service.get(session, who.project_id, reward_function_id)
        return trials.prepare_reward_test(session, who.project_id, fn.spec, body, settings=settings)

    return trials.reward_test_result(await score(request, who.project_id, prepare))
