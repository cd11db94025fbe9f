"""Hand a request to a serving worker and read its reply messages (blocking: run it in a thread).

Routing: a worker that keeps the request's base resident (its queue is named
after the base) is preferred; otherwise a worker that loads any base; with
neither alive, or none taking the request within `serve_accept_timeout_s`,
the caller gets 503 with Retry-After. A request left in a queue carries its
deadline, past which a worker drops it unanswered.

Reply messages, in order: accepted; start (prompt_tokens) or error; then
delta (index, text) and finish (index, reason, tokens) per choice; end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from service.errors import ServiceError
from service.serving.channel import ANY_BASE, PREFIX, Channel, presence_key, request_queue
from service.settings import Settings

RETRY_AFTER_S = 5


class ServingUnavailable(ServiceError):
    status = 503
    code = "model_unavailable"

    def __init__(self, message: str):
        super().__init__(message)
        self.retry_after_s = RETRY_AFTER_S


class WorkerError(ServiceError):
    """An error a serving worker reported (a prompt too long, an adapter that would not load)."""

    def __init__(self, message: str, status: int, param: str | None, code: str | None):
        super().__init__(message, param=param, code=code)
        self.status = status


def send(channel: Channel, settings: Settings, base: str, message: dict) -> str:
    """Queue `message` for a worker serving `base`; returns the key its replies arrive on."""
    if channel.alive(presence_key(base)):
        queue = request_queue(base)
    elif channel.alive(presence_key(ANY_BASE)):
        queue = request_queue(ANY_BASE)
    else:
        raise ServingUnavailable(f"no serving worker is running for {base!r}; start one with "
                                 f"`cispo serve --model {base}` (or `cispo serve` for any base)")
    reply = f"{PREFIX}:reply:{uuid.uuid4().hex}"
    ttl = settings.serve_accept_timeout_s
    channel.push(queue, {**message, "reply": reply, "deadline": time.time() + ttl}, ttl_s=ttl)
    return reply


def replies(channel: Channel, settings: Settings, reply: str) -> Iterator[dict]:
    """The worker's messages after `accepted`, up to `end` (exclusive); a reported error raises WorkerError."""
    got = channel.pop([reply], settings.serve_accept_timeout_s)
    if got is None:
        raise ServingUnavailable(f"no serving worker took the request within {settings.serve_accept_timeout_s:g} s "
                                 "(all busy, or none running)")
    while True:
        got = channel.pop([reply], settings.serve_reply_timeout_s)
        if got is None:
            raise ServingUnavailable(f"the serving worker stopped answering (nothing for "
                                     f"{settings.serve_reply_timeout_s:g} s)")
        message = got[1]
        if message["type"] == "end":
            return
        if message["type"] == "error":
            raise WorkerError(message["message"], message.get("status", 500), message.get("param"),
                              message.get("code"))
        yield message
