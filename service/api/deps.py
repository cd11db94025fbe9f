"""Dependencies, as Annotated aliases so a route's signature reads like a declaration of what it needs.

The ones that only read app or request state are `async def`: FastAPI runs a plain `def` dependency in
the threadpool, a thread hop per request that costs more than the lookup itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from service.api.poll_cache import PollCache
from service.auth import Principal, Unauthenticated
from service.settings import Settings
from service.storage import ObjectStore


def _session(request: Request) -> Iterator[Session]:
    # GET routes only read: on SQLite their sessions never take the write lock (service/db/session.py).
    reads = request.method in ("GET", "HEAD")
    session = (request.app.state.read_sessions if reads else request.app.state.sessions)()
    try:
        yield session
    finally:
        session.close()  # rolls back whatever the route did not commit


# scope="function": the session closes when the route returns, before a streamed body is sent,
# so no transaction (on SQLite: no write lock) is held while bytes trickle out.
SessionDep = Annotated[Session, Depends(_session, scope="function")]


async def _principal(request: Request) -> Principal:
    # Set by service/api/access.py before the body was read; absent only outside /v1.
    principal = getattr(request.state, "principal", None)
    if principal is None:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    return principal


PrincipalDep = Annotated[Principal, Depends(_principal)]


async def _store(request: Request) -> ObjectStore:
    return request.app.state.store


StoreDep = Annotated[ObjectStore, Depends(_store)]

Enqueue = Callable[[str], None]


async def _enqueue(request: Request) -> Enqueue:
    return request.app.state.enqueue


EnqueueDep = Annotated[Enqueue, Depends(_enqueue)]


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(_settings)]


async def _poll_cache(request: Request) -> PollCache:
    return request.app.state.poll_cache


PollCacheDep = Annotated[PollCache, Depends(_poll_cache)]
