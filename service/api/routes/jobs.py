"""/v1/fine_tuning/jobs: create, list, retrieve, cancel, pause, resume (OpenAI's paths and shapes)."""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated

from anyio import from_thread
from fastapi import APIRouter, File, Form, Header, Query, Request, Response, UploadFile
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError

from service import files as files_service
from service import jobs as jobs_service
from service.dry_run import dry_run as run_dry_run
from service.api import presenters
from service.api.deps import Enqueue, EnqueueDep, PollCacheDep, PrincipalDep, SessionDep, SettingsDep, StoreDep
from service.api.poll_cache import JOB, PollCache
from service.auth import Principal
from service.db.models import Job
from service.errors import InvalidRequest, invalid_value
from service.repositories import job_messages, job_queue
from service.settings import Settings
from service.schemas.api import DryRunCheck, DryRunObject, JobObject, ListObject
from service.job_spec.request import JobCreate

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning jobs"])

_METADATA_PARAM = re.compile(r"^metadata\[(.+)\]$")
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200)]


def _send(enqueue: Enqueue, job_id: str, session) -> None:
    """Hand the id to the broker. The committed row is the truth: if the broker is down, the job is marked
    as owed a message and the reconciler's next pass sends it, so the client still gets its job (not an
    error that would make it retry and create a second one)."""
    try:
        enqueue(job_id)
    except Exception:
        log.exception("could not enqueue job %s; the reconciler sends it on its next pass", job_id)
        try:
            job_messages.mark_unsent(session, job_id)
            session.commit()
        except Exception:  # the database too: the reconciler's resend of old queued jobs still finds it
            log.exception("could not mark job %s as owed a message", job_id)
            session.rollback()


def _queue_positions(session, settings: Settings, jobs: list[Job]) -> dict[str, int]:
    return job_queue.positions(session, jobs, fair=settings.worker_jobs > 1, weights=settings.project_weights)


def _present(session, who: Principal, job: Job, settings: Settings) -> JobObject:
    rows = jobs_service.training_rows(session, who.project_id, [job])
    return presenters.job(job, who, rows.get(job.training_file), _queue_positions(session, settings, [job]).get(job.id))


def _dry_run(session, store, who: Principal, settings: Settings, body: JobCreate) -> DryRunObject:
    try:
        prepared = jobs_service.prepare(session, who.project_id, body, settings=settings)
        report = run_dry_run(session, store, who.project_id, body, prepared.spec, hub_url=settings.model_hub_url,
                             hub_cache=settings.resolved_hf_hub_cache(), hub_offline=settings.hf_hub_offline)
    finally:
        session.rollback()
    return DryRunObject(spec=prepared.spec.model_dump(mode="json"), estimated_seconds=report.estimated_seconds,
                        expected_trained_tokens=report.expected_trained_tokens,
                        expected_worker_seconds=report.expected_worker_seconds,
                        checks=[DryRunCheck(**vars(c)) for c in report.checks])


@router.post("/dry_run", response_model=DryRunObject)
def dry_run_with_files(session: SessionDep, who: PrincipalDep, settings: SettingsDep, store: StoreDep,
                       job: Annotated[str, Form(description="the POST /v1/fine_tuning/jobs body, as JSON")],
                       training_file: Annotated[UploadFile | None, File()] = None,
                       validation_file: Annotated[UploadFile | None, File()] = None) -> DryRunObject:
    """The dry run of a job whose dataset files are not uploaded yet: each file sent here is checked as an upload
    is, stands in for the body's field of its name for this one check, and is kept nowhere (no file id, no
    stored bytes), so a client checks a job with local files without uploading them."""
    try:
        data = json.loads(job)
    except ValueError as e:
        raise InvalidRequest(f"job: not valid JSON ({e})", param="job", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("job: must be a JSON object (the job's request body)", param="job")
    held = []
    try:
        for field, upload in (("training_file", training_file), ("validation_file", validation_file)):
            if upload is not None:
                try:
                    file = files_service.create(session, store, who.project_id, filename=upload.filename,
                                                purpose=files_service.PURPOSE, src=upload.file,
                                                max_line_bytes=settings.max_upload_line_bytes)
                except InvalidRequest as e:
                    raise InvalidRequest(f"{field}: {e.message.removeprefix('file: ')}", param=field,
                                         code=e.code) from None
                held.append(file)
                data[field] = file.id
        try:
            body = JobCreate.model_validate(data)
        except ValidationError as e:
            raise invalid_value(e, data) from None
        return _dry_run(session, store, who, settings, body)
    finally:
        session.rollback()
        for file in held:
            files_service.discard_object(store, file)


@router.post("", response_model=JobObject | DryRunObject)
def create_job(body: JobCreate, session: SessionDep, who: PrincipalDep, enqueue: EnqueueDep, settings: SettingsDep,
               store: StoreDep, idempotency_key: IdempotencyKey = None,
               dry_run: bool = False) -> JobObject | DryRunObject:
    if dry_run:
        return _dry_run(session, store, who, settings, body)
    try:
        job, created = jobs_service.create(session, who.project_id, body, idempotency_key=idempotency_key,
                                           settings=settings, store=store)
        public = _present(session, who, job, settings)
        session.commit()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the insert: answer with its job.
        session.rollback()
        earlier = idempotency_key and jobs_service.replay(session, who.project_id, idempotency_key,
                                                          jobs_service.request_digest(body))
        if not earlier:
            raise
        job, created, public = earlier, False, _present(session, who, earlier, settings)
        session.commit()
    if created:
        _send(enqueue, job.id, session)  # only now: the worker must find the committed row
    return public


@router.get("", response_model=ListObject[JobObject])
def list_jobs(request: Request, session: SessionDep, who: PrincipalDep, settings: SettingsDep, after: str | None = None,
              limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    metadata = {m.group(1): v for k, v in request.query_params.multi_items() if (m := _METADATA_PARAM.match(k))}
    rows = jobs_service.list_jobs(session, who.project_id, after=after, limit=limit, metadata=metadata)
    return presenters.jobs(rows, who, jobs_service.training_rows(session, who.project_id, rows.items),
                           _queue_positions(session, settings, rows.items))


@router.get("/{fine_tuning_job_id}", response_model=JobObject)
async def get_job(fine_tuning_job_id: str, request: Request, who: PrincipalDep) -> Response:
    # What pollers ask for: served from the per-project poll cache (service/api/poll_cache.py), on the
    # event loop when it hits; a miss reads in the threadpool.
    def load() -> bytes:
        with request.app.state.read_sessions() as session:
            job = jobs_service.get(session, who.project_id, fine_tuning_job_id)
            return _present(session, who, job, request.app.state.settings).model_dump_json().encode()

    body = await request.app.state.poll_cache.get(who.project_id, fine_tuning_job_id, JOB, load)
    return Response(body, media_type="application/json")


def _control(action: str, job_id: str, session, who: Principal, cache: PollCache, settings: Settings) -> JobObject:
    job = jobs_service.control(session, who.project_id, job_id, action, settings=settings)
    public = _present(session, who, job, settings)
    session.commit()
    # The caller's next GET must see its own change, not a cached answer (the cache lives on the event loop).
    from_thread.run_sync(cache.forget, who.project_id, job_id)
    return public


@router.post("/{fine_tuning_job_id}/cancel", response_model=JobObject)
def cancel_job(fine_tuning_job_id: str, session: SessionDep, who: PrincipalDep, cache: PollCacheDep,
               settings: SettingsDep) -> JobObject:
    return _control("cancel", fine_tuning_job_id, session, who, cache, settings)


@router.post("/{fine_tuning_job_id}/pause", response_model=JobObject)
def pause_job(fine_tuning_job_id: str, session: SessionDep, who: PrincipalDep, cache: PollCacheDep,
              settings: SettingsDep) -> JobObject:
    return _control("pause", fine_tuning_job_id, session, who, cache, settings)


@router.post("/{fine_tuning_job_id}/resume", response_model=JobObject)
def resume_job(fine_tuning_job_id: str, session: SessionDep, who: PrincipalDep, cache: PollCacheDep,
               enqueue: EnqueueDep, settings: SettingsDep) -> JobObject:
    public = _control("resume", fine_tuning_job_id, session, who, cache, settings)
    _send(enqueue, fine_tuning_job_id, session)
    return public
