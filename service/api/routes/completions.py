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
import threading

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from service.api import json_body
from service.api.deps import PrincipalDep
from service.errors import InvalidRequest, ServiceError
from service.serving import dispatch, requests, targets
from service.serving.channel import Channel, cancel_key, open_channel
from service.serving.waits import ServingWaits
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
    channel, waits = _channel(request.app), _waits(request.app)
    message = {"target": target.wire(), "prompts": requests.prompts(parsed), "sampling": requests.sampling(parsed),
               "project_id": who.project_id}
    waits.hold(who.project_id)
    streaming = False
    try:
        reply_key = await waits.run(dispatch.send, channel, settings, target.base, message)
        messages = await waits.run(_first_reply, channel, settings, reply_key)
        reply = Reply(obj, parsed.model)
        if not parsed.stream:
            return JSONResponse(await waits.run(reply.whole, messages))
        streaming = True  # the stream gives the place back when it ends
    finally:
        if not streaming:
            waits.release(who.project_id)
    include_usage = bool((parsed.stream_options or {}).get("include_usage"))
    return _Stream(reply, messages, include_usage, waits, who.project_id,
                   lambda: _cancel(channel, settings, reply_key))


def _resolve(app, project_id: str, model: str) -> targets.Target:
    with app.state.read_sessions() as session:
        return targets.resolve(session, project_id, model, app.state.settings)


def _channel(app) -> Channel:
    if getattr(app.state, "serve_channel", None) is None:
        app.state.serve_channel = open_channel(app.state.settings)
    return app.state.serve_channel


def _waits(app) -> ServingWaits:
    if getattr(app.state, "serving_waits", None) is None:
        settings = app.state.settings
        app.state.serving_waits = ServingWaits(settings.serve_max_waiting, settings.serve_max_waiting_per_project)
    return app.state.serving_waits


def _first_reply(channel: Channel, settings, reply_key: str):
    """Answered up to the worker's first word (start or error), so a refusal is a plain HTTP error."""
    messages = dispatch.replies(channel, settings, reply_key)
    first = next(messages, None)
    if first is None:  # ended before a word: only a worker that broke its protocol does that
        raise dispatch.ServingUnavailable("the serving worker ended the reply without an answer")
    return itertools.chain([first], messages)


def _cancel(channel: Channel, settings, reply_key: str) -> None:
    """Tell the worker the caller is gone, from a thread: the request's own task is being cancelled."""
    def mark() -> None:
        try:
            channel.mark_alive(cancel_key(reply_key), settings.serve_reply_timeout_s)
        except Exception:
            log.exception("serving: could not cancel %s", reply_key)

    threading.Thread(target=mark, daemon=True, name="serve-cancel").start()


class _Stream(StreamingResponse):
    """The reply as server-sent events, each read on a serving thread. However the response ends its place is
    given back; if the client hung up first (Starlette cancels the response), the worker is told to stop."""

    def __init__(self, reply: Reply, messages, include_usage: bool, waits: ServingWaits, project_id: str, cancel):
        super().__init__(self._events(reply, messages, include_usage), media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.waits, self.project_id, self.cancel, self.ended = waits, project_id, cancel, False

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.waits.release(self.project_id)
            if not self.ended:
                self.cancel()

    async def _events(self, reply: Reply, messages, include_usage: bool):
        chunks = reply.chunks(messages, include_usage=include_usage)
        try:
            while (chunk := await self.waits.run(next, chunks, None)) is not None:
                yield sse(chunk)
        except ServiceError as e:  # the worker failed or went silent mid-stream: OpenAI's in-stream error
            log.warning("serving stream %s ended early: %s", reply.id, e.message)
            self.ended = True
            yield sse({"error": {"message": e.message, "type": "server_error", "param": e.param, "code": e.code}})
            return
        self.ended = True
        yield DONE
