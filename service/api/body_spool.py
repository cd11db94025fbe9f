"""Request bodies are received before a request takes its admission place, under a deadline and a minimum rate.

uvicorn has no body timeout, and the app reads a body while it holds one of
the `api_threads` admission places (service/api/access.py): 40 uploads that
never finish their body would hold every place, and every tenant's GET would
wait behind them. So, once the caller is authenticated (an anonymous body is
never read), BodySpool:

- takes one of the project's upload slots (multipart bodies only; over the
  cap: 429 at once, the body unread). The slots are per API process: what
  they protect is this process's sockets and scratch disk;
- leaves admission and receives the whole body into a spooled temporary file
  (memory up to 1 MiB, then disk), giving up with 408 when it is slower than
  `body_min_bytes_per_s` on average after `body_grace_s`, or not complete in
  `body_timeout_s`;
- takes an admission place again and hands the app the body from the spool.

It sits inside BodySizeLimit, whose count refuses an oversized body while it
is being spooled.
"""

from __future__ import annotations

import time
from tempfile import SpooledTemporaryFile

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.access import PROTECTED_PREFIX
from service.api.envelope import error_response, service_error_response
from service.api.ratelimit import Slots
from service.errors import TooManyRequests
from service.settings import Settings

SPOOL_MEMORY_BYTES = 1 << 20
REPLAY_CHUNK = 1 << 16
UPLOADS = "uploads"  # named in the 429


class BodyTooSlow(Exception):
    def __init__(self, received: int, elapsed_s: float, why: str):
        super().__init__(f"the request body did not arrive in time: {received} bytes in {elapsed_s:.0f} s ({why}); "
                         "send it faster or in smaller files")


def _has_body(scope: Scope) -> bool:
    headers = dict(scope.get("headers", []))
    length = headers.get(b"content-length")
    return (length is not None and length != b"0") or b"chunked" in headers.get(b"transfer-encoding", b"").lower()


def _is_upload(scope: Scope) -> bool:
    return dict(scope.get("headers", [])).get(b"content-type", b"").lower().startswith(b"multipart/form-data")


class BodySpool:
    def __init__(self, app: ASGIApp, *, settings: Settings):
        self.app = app
        self.timeout_s, self.grace_s = settings.body_timeout_s, settings.body_grace_s
        self.min_rate = settings.body_min_bytes_per_s
        self.uploads = Slots(per_owner=settings.uploads_per_project, total=settings.uploads_total, what=UPLOADS,
                             retry_after_s=5.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX) or not _has_body(scope):
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        project = getattr(state.get("principal"), "project_id", None)
        held = project is not None and _is_upload(scope)
        if held:
            try:
                self.uploads.acquire(project)
            except TooManyRequests as exc:
                return await service_error_response(exc)(scope, receive, send)
        try:
            with SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES) as spool:
                if (leave := state.get("leave_admission")) is not None:
                    leave()  # waiting on the network holds no place
                try:
                    if not await self._receive_into(spool, receive):
                        return  # the client hung up
                except BodyTooSlow as exc:
                    response = error_response(408, str(exc), code="request_timeout", headers={"connection": "close"})
                    return await response(scope, receive, send)
                if (join := state.get("join_admission")) is not None:
                    await join()
                size = spool.tell()
                spool.seek(0)
                await self.app(scope, _replay(spool, size, receive), send)
        finally:
            if held:
                self.uploads.release(project)

    async def _receive_into(self, spool: SpooledTemporaryFile, receive: Receive) -> bool:
        """Write the body to `spool`; False when the client disconnected first."""
        started = time.monotonic()
        received = 0
        while True:
            # The body so far buys time at the minimum rate; the whole body has a hard deadline.
            by_rate = started + self.grace_s + received / self.min_rate
            until = min(by_rate, started + self.timeout_s)
            with anyio.move_on_after(max(0.0, until - time.monotonic())) as waited:
                message = await receive()
            if waited.cancelled_caught:
                why = (f"the limit is {self.timeout_s:g} s" if until < by_rate else
                       f"slower than the minimum of {self.min_rate} bytes/s")
                raise BodyTooSlow(received, time.monotonic() - started, why)
            if message["type"] == "http.disconnect":
                return False
            chunk = message.get("body", b"")
            received += len(chunk)
            spool.write(chunk)
            if not message.get("more_body", False):
                return True


def _replay(spool: SpooledTemporaryFile, size: int, receive: Receive) -> Receive:
    """A receive() that gives the spooled body, then the connection's own messages (e.g. its disconnect)."""
    done = False

    async def replay() -> Message:
        nonlocal done
        if done:
            return await receive()
        chunk = spool.read(REPLAY_CHUNK)
        done = spool.tell() >= size
        return {"type": "http.request", "body": chunk, "more_body": not done}

    return replay
