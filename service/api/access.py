"""Authentication and the per-key rate limit, as ASGI middleware in front of every /v1 route.

It runs before anything reads the request body: an unauthenticated or
over-limit caller gets its 401 / 429 while its upload is still unread (a
FastAPI dependency would be too late, since FastAPI parses form bodies
before it resolves dependencies). The principal is left in the request
state, where PrincipalDep picks it up. The key lookup is blocking SQL, so it
runs in the threadpool, never on the event loop.
"""

from __future__ import annotations

from anyio import to_thread
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.envelope import database_unavailable, service_error_response
from service.api.ratelimit import TokenBuckets
from service.auth import authenticate
from service.errors import ServiceError

PROTECTED_PREFIX = "/v1/"


class Authenticate:
    def __init__(self, app: ASGIApp, *, reads: sessionmaker[Session], writes: sessionmaker[Session],
                 limits: TokenBuckets):
        self.app, self.reads, self.writes, self.limits = app, reads, writes, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            return await self.app(scope, receive, send)
        authorization = dict(scope["headers"]).get(b"authorization")
        try:
            principal = await to_thread.run_sync(authenticate, self.reads, self.writes,
                                                 authorization.decode("latin-1") if authorization else None)
            self.limits.take(principal.key_id)
        except ServiceError as exc:
            return await service_error_response(exc)(scope, receive, send)
        except OperationalError as exc:
            return await database_unavailable(scope["method"], scope["path"], exc)(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)
