"""What a job leaves behind, read-only: events, checkpoints (and their bytes), per-step metrics, samples."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from service import jobs as jobs_service
from service.api import event_stream, presenters
from service.api.deps import PrincipalDep, SessionDep, StoreDep
from service.errors import InvalidRequest, NotFound
from service.repositories import job_outputs as outputs_repo
from service.repositories import jobs as jobs_repo
from service.schemas.api import CheckpointObject, EventObject, ListObject, MetricList, SampleObject
from service.storage import ObjectStore
from service.storage_layout import ARCHIVE, MANIFEST, MERGED_ARCHIVE, SERVED_DIRS

router = APIRouter(prefix="/v1/fine_tuning/jobs/{fine_tuning_job_id}", tags=["fine-tuning jobs"])


@router.get("/events", response_model=ListObject[EventObject],
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "A page of events, newest first; with stream=true, server-sent events."}})
async def list_events(fine_tuning_job_id: str, request: Request, who: PrincipalDep, after: str | None = None,
                      limit: Annotated[int, Query(ge=1, le=100)] = 20,
                      stream: Annotated[bool, Query(description="Stream events, oldest first, until the job ends "
                                                                "(text/event-stream; resume with Last-Event-ID).")] = False,
                      include_metrics: Annotated[bool, Query(description="Streams: the per-step progress "
                                                                         "events (type 'metrics', one per training "
                                                                         "step and evaluation); false leaves them "
                                                                         "out.")] = True,
                      last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)] = None
                      ) -> Response:
    if stream:
        def start() -> tuple[str, int]:
            with request.app.state.read_sessions() as session:
                job = jobs_service.get(session, who.project_id, fine_tuning_job_id)
                after_seq = outputs_repo.event_seq(session, job.id, last_event_id) if last_event_id else 0
                if after_seq is None:
                    raise InvalidRequest(f"Last-Event-ID: {last_event_id!r} is not an event of this job",
                                         param="Last-Event-ID")
                return job.id, after_seq

        job_id, after_seq = await run_in_threadpool(start)
        body = event_stream.stream(request, request.app.state.sessions, job_id, after_seq=after_seq,
                                   include_metrics=include_metrics)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    # Polled like the job itself: served from the per-project poll cache (service/api/poll_cache.py).
    def load() -> bytes:
        with request.app.state.read_sessions() as session:
            job = jobs_service.get(session, who.project_id, fine_tuning_job_id)
            rows = jobs_repo.events(session, job.id, after=after, limit=limit)
            return presenters.page([presenters.event(r) for r in rows.items], rows.has_more).model_dump_json().encode()

    body = await request.app.state.poll_cache.get(who.project_id, fine_tuning_job_id, ("events", after, limit), load)
    return Response(body, media_type="application/json")


@router.get("/checkpoints", response_model=ListObject[CheckpointObject])
def list_checkpoints(fine_tuning_job_id: str, session: SessionDep, who: PrincipalDep, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 10) -> ListObject:
    job = jobs_service.get(session, who.project_id, fine_tuning_job_id)
    rows = jobs_repo.checkpoints(session, job.id, after=after, limit=limit)
    return presenters.page([presenters.checkpoint(r, job, who) for r in rows.items], rows.has_more)


@router.get("/metrics", response_model=MetricList)
def list_metrics(fine_tuning_job_id: str, session: SessionDep, who: PrincipalDep,
                 name: Annotated[list[str] | None, Query()] = None,
                 step_min: Annotated[int | None, Query(ge=0)] = None,
                 step_max: Annotated[int | None, Query(ge=0)] = None,
                 limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> MetricList:
    """A time series: oldest step first, then by name (unlike events and checkpoints, newest first);
    with has_more, ask again with step_min past the last step shown."""
    job = jobs_service.get(session, who.project_id, fine_tuning_job_id)
    rows = jobs_repo.metrics(session, job.id, names=name, step_min=step_min, step_max=step_max, limit=limit + 1)
    return MetricList(data=[presenters.metric(r) for r in rows[:limit]], has_more=len(rows) > limit)


@router.get("/samples", response_model=ListObject[SampleObject])
def list_samples(fine_tuning_job_id: str, session: SessionDep, who: PrincipalDep,
                 step: Annotated[int | None, Query(ge=0)] = None, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> ListObject:
    """A few completions per step, newest step first: each group's best and worst, for the step's first 8 groups."""
    job = jobs_service.get(session, who.project_id, fine_tuning_job_id)
    if after is not None:
        try:
            outputs_repo.parse_sample_id(after)
        except ValueError:
            raise InvalidRequest(f"after: {after!r} is not a sample id (ftsample-<step>-<slot>)",
                                 param="after") from None
    rows = outputs_repo.samples(session, job.id, step=step, after=after, limit=limit)
    return presenters.page([presenters.sample(r) for r in rows.items], rows.has_more)


def _stream(store: ObjectStore, key: str, sha256: str, filename: str, media_type: str) -> StreamingResponse:
    chunks = store.iter_bytes(key)  # raises NotFound now, before any header is sent
    return StreamingResponse(chunks, media_type=media_type, headers={
        "content-length": str(store.size(key)), "x-sha256": sha256,
        "content-disposition": f'attachment; filename="{re.sub(r"[^A-Za-z0-9_.-]", "_", filename)}"'})


@router.get("/checkpoints/{checkpoint_id}/content")
def checkpoint_content(fine_tuning_job_id: str, checkpoint_id: str, session: SessionDep, store: StoreDep,
                       who: PrincipalDep) -> StreamingResponse:
    """The whole checkpoint as one tar (adapter/ or model/, reference/ if pinned, trainer_state.*, manifest.json),
    hashed so the client can verify what it got: unpacked, it is a starting point for a local `init_from`."""
    _, ckpt = jobs_service.checkpoint(session, who.project_id, fine_tuning_job_id, checkpoint_id)
    meta = (ckpt.files or {}).get(ARCHIVE)
    if not meta:
        raise NotFound(f"checkpoint {checkpoint_id} has no adapter archive", param="checkpoint_id")
    return _stream(store, f"{ckpt.storage_prefix}/{ARCHIVE}", meta["sha256"], f"{ckpt.id}-adapter.tar",
                   "application/x-tar")


@router.get("/checkpoints/{checkpoint_id}/merged")
def checkpoint_merged(fine_tuning_job_id: str, checkpoint_id: str, session: SessionDep, store: StoreDep,
                      who: PrincipalDep) -> StreamingResponse:
    """The adapter merged into the base model as one tar (config.json, tokenizer, model.safetensors, manifest.json
    with each file's sha256): unpacked, a directory that AutoModelForCausalLM.from_pretrained loads."""
    _, ckpt = jobs_service.checkpoint(session, who.project_id, fine_tuning_job_id, checkpoint_id)
    meta = (ckpt.files or {}).get(MERGED_ARCHIVE)
    if not meta:
        raise NotFound(f"checkpoint {checkpoint_id} has no merged model: a job stores one with each checkpoint when "
                       "method.cispo.hyperparameters.training.export is 'merged' (and the merge succeeded: see the "
                       "job's events)", param="checkpoint_id")
    return _stream(store, f"{ckpt.storage_prefix}/{MERGED_ARCHIVE}", meta["sha256"], f"{ckpt.id}-merged.tar",
                   "application/x-tar")


@router.get("/checkpoints/{checkpoint_id}/files/{path:path}")
def checkpoint_file(fine_tuning_job_id: str, checkpoint_id: str, path: str, session: SessionDep,
                    store: StoreDep, who: PrincipalDep) -> StreamingResponse:
    """One adapter file, merged model file or the manifest; trainer state (optimizer, RNG) is not for download."""
    _, ckpt = jobs_service.checkpoint(session, who.project_id, fine_tuning_job_id, checkpoint_id)
    meta = (ckpt.files or {}).get(path)
    if not meta or not (path.startswith(SERVED_DIRS) or path == MANIFEST):
        raise NotFound(f"checkpoint {checkpoint_id} has no downloadable file {path!r}", param="path")
    media = "application/json" if path.endswith(".json") else "application/octet-stream"
    return _stream(store, f"{ckpt.storage_prefix}/{path}", meta["sha256"], path.rsplit("/", 1)[-1], media)
