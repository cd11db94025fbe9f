"""/v1/fine_tuning/alpha/graders/{run,validate}: OpenAI's grader endpoints, so the SDK's
client.fine_tuning.alpha.graders.run/validate work. A grader runs exactly as it would in a job
(mapped by service/schemas/graders.py, scored in a subprocess by service/rewards/runner.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service.api.deps import PrincipalDep, SessionDep, SettingsDep
from service.api.scoring import score
from service.rewards import trials
from service.schemas.scoring_api import GraderRunRequest, GraderValidateRequest

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["graders"])


@router.post("/run")
async def run_grader(request: Request, body: GraderRunRequest, session: SessionDep, who: PrincipalDep,
                     settings: SettingsDep) -> dict[str, Any]:
    answer = await score(request, who.project_id, lambda: trials.prepare_grader_run(
        session, who.project_id, body, settings=settings))
    return trials.grader_run_result(body, answer)


@router.post("/validate")
def validate_grader(body: GraderValidateRequest, who: PrincipalDep) -> dict[str, Any]:
    return trials.validate_grader(body.grader)
