"""Admission, authentication and the per-key rate limit, as ASGI middleware in front of every /v1 and /api/v1
route.

It runs before anything reads the request body: an unauthenticated or
over-limit caller gets its 401 / 429 while its upload is still unread (a
FastAPI dependency would be too late, since FastAPI parses form bodies
before it resolves dependencies). The principal is left in the request
state, where PrincipalDep picks it up. The key lookup is blocking SQL, so it
runs in the threadpool, never on the event loop; a key found within the last
`auth_cache_s` is taken from PrincipalCache without leaving the loop.
"""

from __future__ import annotations

from anyio import to_thread
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.envelope import database_unavailable, service_error_response
from service.api.limits import RateLimit
from service.auth import PrincipalCache, authenticate, bearer_from_api_key
from service.errors import ServiceError

# The OpenAI-shaped API, and the Tinker API (service/api/routes/tinker.py), whose SDK sends its key as X-API-Key.
PROTECTED_PREFIX = ("/v1/", "/api/v1/")


class Admission:
    """At most `api_threads` requests inside the app at once; the rest wait here, on the event loop.

    A sync route holds a pooled connection from its first query until its session closes, which is after
    FastAPI has serialized the response in the threadpool. With more requests in flight than threads, the
    threads could all be taken by routes waiting for a connection, while every connection is held by a
    route waiting for a thread to serialize its response: the pool then times out (seen at 200 pollers).
    Admitting no more requests than threads (and the pool has threads + 4 connections) makes that cycle
    impossible. A request leaves when its response starts, so a slow download holds no place, or earlier
    through `request.state.leave_admission()` once it holds no connection (a reward test while it scores,
    a body on its way over the network: service/api/body_spool.py), which `join_admission()` takes back.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        # Made in the serving loop by the lifespan (service/api/app.py); an app driven without its lifespan
        # (a bare TestClient) has none and admits everyone.
        places = getattr(scope["app"].state, "admission", None)
        if places is None:
            return await self.app(scope, receive, send)
        await places.acquire()
        admitted = True

        def leave() -> None:
            nonlocal admitted
            if admitted:
                admitted = False
                places.release()

        async def send_and_leave(message: Message) -> None:
            if message["type"] == "http.response.start":
                leave()
            await send(message)

        async def join() -> None:
            nonlocal admitted
            if not admitted:
                await places.acquire()
                admitted = True

        scope.setdefault("state", {}).update(leave_admission=leave, join_admission=join)
        try:
            await self.app(scope, receive, send_and_leave)
        finally:
            leave()


class Authenticate:
    def __init__(self, app: ASGIApp, *, reads: sessionmaker[Session], writes: sessionmaker[Session],
                 limits: RateLimit, principals: PrincipalCache):
        self.app, self.reads, self.writes, self.limits, self.principals = app, reads, writes, limits, principals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        raw = headers.get(b"authorization")
        authorization = raw.decode("latin-1") if raw else None
        if authorization is None and (api_key := headers.get(b"x-api-key")):
            authorization = bearer_from_api_key(api_key.decode("latin-1"))
        try:
            principal = self.principals.get(authorization)
            if principal is None:
                started = self.principals.clock()
                principal = await to_thread.run_sync(authenticate, self.reads, self.writes, authorization)
                self.principals.put(authorization, principal, started)
            await self.limits.take(principal.key_id)
        except ServiceError as exc:
            return await service_error_response(exc)(scope, receive, send)
        except OperationalError as exc:
            return await database_unavailable(scope["method"], scope["path"], exc)(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)
