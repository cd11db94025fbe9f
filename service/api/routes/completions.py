"""POST /v1/chat/completions and /v1/completions: a project's fine-tuned models and allowed bases, as OpenAI serves.

The route validates the body (400 naming the field), resolves `model` for
the caller's project (404 for anything it may not call), and hands the
request to a serving worker (service/serving/dispatch.py), whose messages it
returns as one object or, with `stream: true`, as server-sent events ending
in `data: [DONE]`. Authentication and the per-key rate limit are the /v1
middleware's (service/api/access.py), as for every other route.
"""

from __future__ import annotations

import itertools
import logging

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.api import json_body
from service.api.deps import PrincipalDep
from service.errors import InvalidRequest, ServiceError
from service.serving import dispatch, requests, targets
from service.serving.channel import Channel, open_channel
from service.serving.replies import CHAT, DONE, TEXT, Reply, sse

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["serving"])


@router.post("/chat/completions")
async def chat_completions(request: Request, who: PrincipalDep):
    return await _serve(request, who, requests.ChatRequest, CHAT)


@router.post("/completions")
async def completions(request: Request, who: PrincipalDep):
    return await _serve(request, who, requests.CompletionRequest, TEXT)


async def _serve(request: Request, who, kind: type, obj: str):
    body = json_body.load(await request.body())
    parsed = requests.parse(kind, body)
    settings = request.app.state.settings
    if parsed.budget() > settings.serve_max_tokens:
        field = "max_completion_tokens" if getattr(parsed, "max_completion_tokens", None) else "max_tokens"
        raise InvalidRequest(f"{field}: at most {settings.serve_max_tokens} tokens", param=field,
                             code="invalid_value")
    target = await to_thread.run_sync(_resolve, request.app, who.project_id, parsed.model)
    if (leave := getattr(request.state, "leave_admission", None)) is not None:
        leave()  # from here on it waits on a worker and holds no database connection
    channel = _channel(request.app)
    message = {"target": target.wire(), "prompts": requests.prompts(parsed), "sampling": requests.sampling(parsed),
               "project_id": who.project_id}
    messages = await to_thread.run_sync(_first_reply, channel, settings, target.base, message)
    reply = Reply(obj, parsed.model)
    if not parsed.stream:
        return JSONResponse(await to_thread.run_sync(reply.whole, messages))
    include_usage = bool((parsed.stream_options or {}).get("include_usage"))
    return StreamingResponse(_events(reply, messages, include_usage), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def _resolve(app, project_id: str, model: str) -> targets.Target:
    with app.state.read_sessions() as session:
        return targets.resolve(session, project_id, model, app.state.settings)


def _channel(app) -> Channel:
    if getattr(app.state, "serve_channel", None) is None:
        app.state.serve_channel = open_channel(app.state.settings)
    return app.state.serve_channel


def _first_reply(channel: Channel, settings, base: str, message: dict):
    """Sent and answered up to the worker's first word (start or error), so a refusal is a plain HTTP error."""
    reply_key = dispatch.send(channel, settings, base, message)
    messages = dispatch.replies(channel, settings, reply_key)
    first = next(messages, None)
    if first is None:  # ended before a word: only a worker that broke its protocol does that
        raise dispatch.ServingUnavailable("the serving worker ended the reply without an answer")
    return itertools.chain([first], messages)


def _events(reply: Reply, messages, include_usage: bool):
    # A plain generator: Starlette runs it in the threadpool, where the channel's blocking reads belong.
    try:
        for chunk in reply.chunks(messages, include_usage=include_usage):
            yield sse(chunk)
    except ServiceError as e:  # the worker failed or went silent mid-stream: OpenAI's in-stream error
        log.warning("serving stream %s ended early: %s", reply.id, e.message)
        yield sse({"error": {"message": e.message, "type": "server_error", "param": e.param, "code": e.code}})
        return
    yield DONE
