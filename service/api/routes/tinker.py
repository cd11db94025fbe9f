"""/api/v1: the Tinker API, so the unmodified Tinker SDK and tinker-cookbook run against this service.

A call that does work (create_model, forward_backward, optim_step, save/load weights, asample) is written as a
request row (service/repositories/tinker.py) and answered with its request id at once; the runner
(worker/tinker/) executes rows and writes their results back. POST /retrieve_future long-polls that row. The
rest (sessions, samplers, capabilities) is answered here. Unknown methods and losses this service does not
train are refused at submission with a 400 that names them, which the SDK raises at once (it retries 408, 409,
429 and 5xx for minutes, so a permanent refusal is none of those).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from service.api.deps import PrincipalDep, SessionDep, SettingsDep
from service.db.models import TinkerModel
from service.errors import InvalidRequest, NotFound, invalid_value
from service.models.source import check_model
from service.repositories import tinker as repo
from service.settings import Settings
from service.tinker import requests as sdk
from service.tinker.wire import PROTOBUF_CONTENT_TYPE, WireError, decode_forward_backward

router = APIRouter(prefix="/api/v1", tags=["tinker"])

# The losses worker/engine/losses.py trains (tests/service/tinker/test_api.py keeps the two lists equal).
SERVED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")


class QuotaExceeded(InvalidRequest):
    """A per-project Tinker quota. A 400, not a 429: the SDK would retry a 429 for five minutes, while the
    quota frees up only when the project ends a session or its checkpoints expire."""

    code = "quota_exceeded"


async def _body(request: Request, model: type[sdk.SdkBody]):
    """The JSON body as `model`: a 400 naming the field, never a 500, for one that is not."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise InvalidRequest("the request body is not valid JSON", code="invalid_json") from None
    try:
        return model.model_validate(data), raw or b"{}"
    except ValidationError as e:
        raise invalid_value(e, data) from None


def _live_session(session, project_id: str, session_id: str):
    row = repo.get_session(session, project_id, session_id)
    if row is None:
        raise NotFound(f"session_id: no session {session_id!r}", param="session_id")
    if row.finished_at is not None:
        raise InvalidRequest(f"session_id: session {session_id!r} has ended; create a new ServiceClient",
                             param="session_id", code="session_ended")
    return row


def _check_base(base_model: str, settings: Settings, param: str) -> None:
    if base_model.startswith("/"):
        check_model(base_model, settings)  # under CISPO_MODEL_DIRS, or refused
        return
    if base_model not in settings.resolved_tinker_base_models():
        offered = ", ".join(settings.resolved_tinker_base_models()) or "none (the operator lists them in " \
                                                                        "CISPO_TINKER_BASE_MODELS)"
        raise InvalidRequest(f"{param}: {base_model!r} is not a base model this server trains or samples; it "
                             f"offers: {offered}", param=param, code="model_not_found")


def _live_model(session, project_id: str, model_id: str) -> TinkerModel:
    row = repo.get_model(session, project_id, model_id)
    if row is None:
        raise NotFound(f"model_id: no model {model_id!r}", param="model_id")
    if row.released_at is not None:
        raise InvalidRequest(f"model_id: model {model_id!r} was released when its session ended; load a saved "
                             "state into a new training client", param="model_id", code="model_released")
    return row


def _checkpoint(session, project_id: str, path: str, param: str):
    found = repo.resolve_checkpoint(session, project_id, path)
    if found is None:
        raise NotFound(f"{param}: no checkpoint at {path!r}", param=param)
    return found


def _saved_state_room(session, project_id: str, settings: Settings, path: str) -> None:
    if repo.resolve_checkpoint(session, project_id, path) is not None:
        return  # an overwrite takes no new place
    held = repo.saved_checkpoints(session, project_id)
    if held >= settings.tinker_max_saved_states:
        raise QuotaExceeded(f"path: the project holds {held} saved checkpoints, its quota (tinker_max_saved_states"
                            f" = {settings.tinker_max_saved_states}); let some expire before saving more",
                            param="path")


def _training_client_room(session, project_id: str, settings: Settings) -> None:
    live = repo.live_models(session, project_id)
    if live >= settings.tinker_max_training_clients:
        raise QuotaExceeded(f"the project has {live} live training clients, its quota (tinker_max_training_clients"
                            f" = {settings.tinker_max_training_clients}); end a session to free one",
                            param="model_seq_id")


def _future(session, request_id: str, **extra) -> dict:
    session.commit()
    return {"request_id": request_id, **extra}


async def _in_thread(request: Request, work):
    """work(session) in the threadpool, with a writing session of its own (closed, so rolled back unless
    committed, when it returns)."""
    def run():
        with request.app.state.sessions() as session:
            return work(session)

    return await run_in_threadpool(run)


def _model_call(session, who, *, kind: str, model_id: str, seq_id: int, body: bytes, body_type: str) -> dict:
    model = _live_model(session, who.project_id, model_id)
    request_id, _ = repo.submit(session, who.project_id, kind=kind, body=body, body_type=body_type,
                                session_id=model.session_id, model_id=model_id, seq_id=seq_id)
    return _future(session, request_id, model_id=model_id)


# -- the client and its session ------------------------------------------------------


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(who: PrincipalDep) -> dict:
    return {}  # every optional SDK feature off (JWT exchange, compressed bodies, the batched futures poller)


@router.get("/get_server_capabilities")
async def get_server_capabilities(who: PrincipalDep, settings: SettingsDep) -> dict:
    return {"supported_models": [{"model_name": m, "trainable": True, "sampleable": True}
                                 for m in settings.resolved_tinker_base_models()]}


@router.post("/telemetry")
async def telemetry(who: PrincipalDep) -> dict:
    return {"status": "accepted"}  # not kept: this server's own logs and metrics say what it did


@router.post("/create_session")
async def create_session(request: Request, who: PrincipalDep) -> dict:
    body, _ = await _body(request, sdk.CreateSession)

    def create(session) -> str:
        session_id = repo.create_session(session, who.project_id, tags=body.tags, user_metadata=body.user_metadata,
                                         sdk_version=body.sdk_version)
        session.commit()
        return session_id

    return {"type": "create_session", "session_id": await _in_thread(request, create)}


@router.post("/session_heartbeat")
def session_heartbeat(body: sdk.SessionRef, session: SessionDep, who: PrincipalDep):
    alive = repo.heartbeat(session, who.project_id, body.session_id)
    session.commit()
    if alive is None:
        raise NotFound(f"session_id: no session {body.session_id!r}", param="session_id")
    if not alive:  # 410: the SDK's word for a session that has ended
        return JSONResponse({"error": f"session {body.session_id} has ended", "category": "user"}, status_code=410)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, session: SessionDep, who: PrincipalDep) -> dict:
    if not repo.finish_session(session, who.project_id, session_id):
        raise NotFound(f"no session {session_id!r}", param="session_id")
    session.commit()
    return {}


# -- training clients --------------------------------------------------------------


@router.post("/create_model")
async def create_model(request: Request, who: PrincipalDep, settings: SettingsDep) -> dict:
    body, raw = await _body(request, sdk.CreateModel)
    _check_base(body.base_model, settings, "base_model")

    def work(session) -> dict:
        _live_session(session, who.project_id, body.session_id)
        model_id = repo.model_id_for(body.session_id, body.model_seq_id)
        if repo.get_model(session, who.project_id, model_id) is None:  # a retry takes no new place
            _training_client_room(session, who.project_id, settings)
        repo.add_model(session, who.project_id, body.session_id, body.model_seq_id, base_model=body.base_model,
                       lora_config=body.lora_config.model_dump(), user_metadata=body.user_metadata)
        request_id, _ = repo.submit(session, who.project_id, kind="create_model", body=raw, body_type="json",
                                    session_id=body.session_id, model_id=model_id, seq_id=repo.CREATE_SEQ_ID)
        return _future(session, request_id, model_id=model_id)

    return await _in_thread(request, work)


@router.post("/get_info")
def get_info(body: sdk.ModelRef, session: SessionDep, who: PrincipalDep) -> dict:
    model = repo.get_model(session, who.project_id, body.model_id)
    if model is None:
        raise NotFound(f"model_id: no model {body.model_id!r}", param="model_id")
    return {"type": "get_info", "model_id": model.id, "is_lora": True, "lora_rank": model.lora_config.get("rank"),
            "model_data": {"model_name": model.base_model, "tokenizer_id": model.base_model}}


@router.get("/training_runs/{training_run_id}")
def get_training_run(training_run_id: str, session: SessionDep, who: PrincipalDep) -> dict:
    """A training client as the SDK's RestClient shows it (the cookbook reads its user_metadata on resume)."""
    model = repo.get_model(session, who.project_id, training_run_id)
    if model is None:
        raise NotFound(f"no training run {training_run_id!r}", param="training_run_id")
    last = repo.last_request_at(session, model.id) or model.created_at
    return {"training_run_id": model.id, "base_model": model.base_model, "model_owner": who.project_name,
            "is_lora": True, "lora_rank": model.lora_config.get("rank"), "corrupted": False,
            "last_request_time": datetime.fromtimestamp(last, timezone.utc).isoformat(),
            "user_metadata": model.user_metadata}


@router.post("/forward_backward")
async def forward_backward(request: Request, who: PrincipalDep) -> dict:
    raw = await request.body()
    if request.headers.get("content-encoding", "identity") != "identity":
        raise InvalidRequest("the body is compressed; this server takes uncompressed protobuf (client/config "
                             "leaves proto_compress_fwdbwd off)", code="unsupported_encoding")
    try:
        call = decode_forward_backward(raw)
    except WireError as e:
        raise InvalidRequest(f"forward_backward: {e}", code="invalid_value") from None
    if call.loss_fn not in SERVED_LOSSES:
        raise InvalidRequest(f"loss_fn: {call.loss_fn!r} is not a loss this server trains; it trains "
                             f"{', '.join(SERVED_LOSSES)}", param="loss_fn", code="unsupported_loss")

    return await _in_thread(request, lambda s: _model_call(
        s, who, kind="forward" if call.forward_only else "forward_backward", model_id=call.model_id,
        seq_id=call.seq_id, body=raw, body_type="protobuf"))


@router.post("/optim_step")
async def optim_step(request: Request, who: PrincipalDep) -> dict:
    body, raw = await _body(request, sdk.OptimStep)
    return await _in_thread(request, lambda s: _model_call(s, who, kind="optim_step", model_id=body.model_id,
                                                           seq_id=body.seq_id, body=raw, body_type="json"))


def _checkpoint_name(name: str | None, param: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise InvalidRequest(f"{param}: a checkpoint name without '/' is required, e.g. 'final'", param=param)
    return name


@router.post("/save_weights")
async def save_weights(request: Request, who: PrincipalDep, settings: SettingsDep) -> dict:
    body, raw = await _body(request, sdk.SaveWeights)
    name = _checkpoint_name(body.path, "path")

    def work(session) -> dict:
        _saved_state_room(session, who.project_id, settings, repo.checkpoint_path(body.model_id, "weights", name))
        return _model_call(session, who, kind="save_weights", model_id=body.model_id, seq_id=body.seq_id,
                           body=raw, body_type="json")

    return await _in_thread(request, work)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, who: PrincipalDep, settings: SettingsDep) -> dict:
    body, raw = await _body(request, sdk.SaveWeightsForSampler)
    if body.path is None and body.sampling_session_seq_id is None:
        raise InvalidRequest("path or sampling_session_seq_id: one is required", param="path")
    if body.path is None and body.kind != "snapshot":
        raise InvalidRequest(f"kind: {body.kind!r} sampling clients are not served; 'snapshot' is",
                             param="kind", code="unsupported_value")
    name = _checkpoint_name(body.path, "path") if body.path is not None else None

    def work(session) -> dict:
        model = _live_model(session, who.project_id, body.model_id)
        if name is not None:
            _saved_state_room(session, who.project_id, settings,
                              repo.checkpoint_path(body.model_id, "sampler_weights", name))
        else:  # the sampler exists from now; the runner gives it its weights (repo.set_sampler_weights)
            repo.add_sampler(session, who.project_id, model.session_id, body.sampling_session_seq_id,
                             base_model=model.base_model, source_model_id=model.id)
        return _model_call(session, who, kind="save_weights_for_sampler", model_id=body.model_id,
                           seq_id=body.seq_id, body=raw, body_type="json")

    return await _in_thread(request, work)


@router.post("/load_weights")
async def load_weights(request: Request, who: PrincipalDep, settings: SettingsDep) -> dict:
    body, raw = await _body(request, sdk.LoadWeights)

    def into_existing(session) -> dict:
        _checkpoint(session, who.project_id, body.path, "path")
        return _model_call(session, who, kind="load_weights", model_id=body.model_id, seq_id=body.seq_id,
                           body=raw, body_type="json")

    def as_new_model(session) -> dict:
        _live_session(session, who.project_id, body.session_id)
        found = _checkpoint(session, who.project_id, body.path, "path")
        source = repo.get_model(session, who.project_id, found.model_id)
        if source is None:
            raise NotFound(f"path: the model that saved {body.path!r} is gone", param="path")
        model_id = repo.model_id_for(body.session_id, body.model_seq_id)
        if repo.get_model(session, who.project_id, model_id) is None:
            _training_client_room(session, who.project_id, settings)
        repo.add_model(session, who.project_id, body.session_id, body.model_seq_id, base_model=source.base_model,
                       lora_config=source.lora_config, user_metadata=body.user_metadata or source.user_metadata)
        request_id, _ = repo.submit(session, who.project_id, kind="load_weights", body=raw, body_type="json",
                                    session_id=body.session_id, model_id=model_id, seq_id=repo.CREATE_SEQ_ID)
        return _future(session, request_id, model_id=model_id)

    if body.model_id is not None and body.seq_id is not None and body.session_id is None:
        return await _in_thread(request, into_existing)
    if body.session_id is not None and body.model_seq_id is not None and body.model_id is None:
        return await _in_thread(request, as_new_model)
    raise InvalidRequest("load_weights: give model_id and seq_id (a load into a model), or session_id and "
                         "model_seq_id (a new model from the checkpoint)", param="model_id")


# -- sampling -----------------------------------------------------------------------


def _sampler_base(session, who, settings: Settings, base_model: str | None, model_path: str | None) -> str:
    if model_path is not None:
        found = _checkpoint(session, who.project_id, model_path, "model_path")
        source = repo.get_model(session, who.project_id, found.model_id)
        if source is None:
            raise NotFound(f"model_path: the model that saved {model_path!r} is gone", param="model_path")
        return source.base_model
    if base_model is None:
        raise InvalidRequest("base_model or model_path: one is required", param="base_model")
    _check_base(base_model, settings, "base_model")
    return base_model


@router.post("/create_sampling_session")
def create_sampling_session(body: sdk.CreateSamplingSession, session: SessionDep, who: PrincipalDep,
                            settings: SettingsDep) -> dict:
    _live_session(session, who.project_id, body.session_id)
    base = _sampler_base(session, who, settings, body.base_model, body.model_path)
    sampler_id = repo.add_sampler(session, who.project_id, body.session_id, body.sampling_session_seq_id,
                                  base_model=base, model_path=body.model_path)
    session.commit()
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, session: SessionDep, who: PrincipalDep) -> dict:
    row = repo.get_sampler(session, who.project_id, sampler_id)
    if row is None:
        raise NotFound(f"no sampler {sampler_id!r}", param="sampler_id")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


@router.post("/asample")
async def asample(request: Request, who: PrincipalDep, settings: SettingsDep) -> dict:
    body, raw = await _body(request, sdk.Sample)

    def work(session) -> dict:
        session_id = None
        if body.sampling_session_id is not None:
            sampler = repo.get_sampler(session, who.project_id, body.sampling_session_id)
            if sampler is None:
                raise NotFound(f"sampling_session_id: no sampler {body.sampling_session_id!r}",
                               param="sampling_session_id")
            if body.seq_id is None:
                raise InvalidRequest("seq_id: required with sampling_session_id", param="seq_id")
            session_id = sampler.session_id
        else:
            _sampler_base(session, who, settings, body.base_model, body.model_path)
        request_id, _ = repo.submit(session, who.project_id, kind="asample", body=raw, body_type="json",
                                    session_id=session_id, sampler_id=body.sampling_session_id,
                                    seq_id=body.seq_id if body.sampling_session_id is not None else None)
        # One id per sample, the same on a retry (the same request id): the SDK names its sequences by them.
        return _future(session, request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in
                                                                 range(body.num_samples)])

    return await _in_thread(request, work)


# -- futures ------------------------------------------------------------------------


def _answer(row: repo.RequestRow) -> Response | None:
    if row.state == "done":
        media = PROTOBUF_CONTENT_TYPE if row.result_type == "protobuf" else "application/json"
        return Response(content=row.result or b"{}", media_type=media)
    if row.state == "failed":
        return JSONResponse({"error": row.error or "the request failed", "category": row.error_category or "server"})
    return None


@router.post("/retrieve_future")
async def retrieve_future(request: Request, who: PrincipalDep, settings: SettingsDep):
    """The request's result once its row has ended; until then the poll is held (up to the tinker_poll_hold_s
    setting) and answered try_again. A held poll holds no thread, no connection and no admission place
    (service/api/access.py): it waits for service/api/future_waits.py to see its row end."""
    body, _ = await _body(request, sdk.RetrieveFuture)
    read_sessions = request.app.state.read_sessions

    def read() -> repo.RequestRow | None:
        with read_sessions() as session:
            return repo.get_request(session, who.project_id, body.request_id)

    row = await run_in_threadpool(read)
    if row is None:
        raise NotFound(f"request_id: no request {body.request_id!r}", param="request_id")
    if (answer := _answer(row)) is None and settings.tinker_poll_hold_s > 0:
        if (leave := getattr(request.state, "leave_admission", None)) is not None:
            leave()
        ended = await request.app.state.future_waits.wait(row.id, settings.tinker_poll_hold_s)
        if (join := getattr(request.state, "join_admission", None)) is not None:
            await join()
        if ended and (row := await run_in_threadpool(read)) is not None:
            answer = _answer(row)
    return answer or {"type": "try_again", "request_id": row.id, "queue_state": "active"}


@router.api_route("/{method:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                  include_in_schema=False)
async def unknown_method(method: str, request: Request, who: PrincipalDep) -> JSONResponse:
    """An SDK method this server does not offer: a 404 that names it, in the SDK's error shape."""
    return JSONResponse({"error": f"this server does not offer the Tinker API method {method!r} "
                                  f"({request.method} /api/v1/{method})", "category": "user"}, status_code=404)
