"""The API app for the dashboard's browser test, run by uvicorn in its own process.

Until the samples endpoint (GET /v1/fine_tuning/jobs/{id}/samples) lands, a stand-in with its documented
shape serves samples from the JSON file named by CISPO_TEST_SAMPLES ({job id: [sample, ...]}), and
404s for jobs not in it, as an API without the endpoint does. With the real endpoint present it is
not added.
"""

from __future__ import annotations

import json
import os

from fastapi import APIRouter

from service import jobs as jobs_service
from service.api.app import create_app as create_service_app
from service.api.deps import PrincipalDep, SessionDep
from service.errors import NotFound

SAMPLES_PATH = "/v1/fine_tuning/jobs/{fine_tuning_job_id}/samples"
stand_in = APIRouter()


@stand_in.get(SAMPLES_PATH)
def samples(fine_tuning_job_id: str, session: SessionDep, who: PrincipalDep) -> dict:
    job = jobs_service.get(session, who.project_id, fine_tuning_job_id)
    with open(os.environ["CISPO_TEST_SAMPLES"]) as f:
        data = json.load(f).get(job.id)
    if data is None:
        raise NotFound(f"no route for GET /v1/fine_tuning/jobs/{job.id}/samples")
    return {"object": "list", "data": data, "has_more": False}


def create_app():
    app = create_service_app()
    if not any(getattr(route, "path", None) == SAMPLES_PATH for route in app.routes):
        app.include_router(stand_in)
    return app
