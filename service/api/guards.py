"""Guards that run before routing, as plain ASGI middleware.

BodySizeLimit: FastAPI sets no body limit of its own by default, and
Content-Length can be absent (chunked uploads) or wrong, so the count happens
on every `http.request` message. Uploads (multipart), JSON bodies and
protobuf ones (the Tinker API's) get separate limits.

RefuseNulInUrl: PostgreSQL text cannot hold NUL, so an id or cursor with a
%00 in it would fail deep in the driver (a 500); it is refused up front.
"""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.envelope import error_response


class BodyTooLarge(HTTPException):
    # An HTTPException, so FastAPI's body parsing re-raises it to our handler unchanged.
    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, *, max_json_bytes: int, max_upload_bytes: int, max_protobuf_bytes: int):
        self.app, self.max_json_bytes, self.max_upload_bytes = app, max_json_bytes, max_upload_bytes
        self.max_protobuf_bytes = max_protobuf_bytes

    def _limit(self, scope: Scope) -> int:
        for name, value in scope.get("headers", []):
            if name == b"content-type" and value.lower().startswith(b"multipart/form-data"):
                return self.max_upload_bytes
            if name == b"content-type" and value.lower().startswith(b"application/x-protobuf"):
                return self.max_protobuf_bytes  # the Tinker SDK's forward_backward chunks
        return self.max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self._limit(scope)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await error_response(413, BodyTooLarge(limit).detail, code="request_too_large")(scope, receive, send)

        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:
            # Raised somewhere the app's handlers did not see it (e.g. a streaming read).
            if started:
                raise
            await error_response(413, exc.detail, code="request_too_large")(scope, receive, send)


class RefuseNulInUrl:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ("\x00" in scope.get("path", "")
                                        or b"\x00" in unquote_to_bytes(scope.get("query_string", b""))):
            response = error_response(400, "the URL contains a NUL (%00) character, which no id or "
                                           "parameter may contain", code="invalid_url")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)
