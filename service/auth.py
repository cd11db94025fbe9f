"""API-key authentication: `Authorization: Bearer <key>` (or the Tinker SDK's `X-API-Key: tml-<key>`) -> the
project every route is scoped to.

It runs before the request body is read (service/api/access.py), so an
unauthenticated caller cannot make the API read, parse or store anything.
The lookup is a read; the key's last_used_at is written at most once a
minute, so pollers do not turn every GET into a write. A found key is
reused for `auth_cache_s` (at most a second, PrincipalCache), so a revoked
key is refused within that bound, not at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from service.db.models import now
from service.errors import ServiceError
from service.repositories import projects

LAST_USED_RESOLUTION_S = 60


class Unauthenticated(ServiceError):
    status = 401
    code = "invalid_api_key"


@dataclass(frozen=True)
class Principal:
    """Who is calling: plain values, so nothing ORM-bound outlives the auth transaction."""

    project_id: str
    project_name: str
    key_id: str


def bearer_key(authorization: str | None) -> str:
    if not authorization:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
    return key


TINKER_KEY_PREFIX = "tml-"


def bearer_from_api_key(api_key: str) -> str:
    """An `X-API-Key` header (the Tinker SDK's) as the Authorization header it stands for. The SDK refuses keys
    that do not start with "tml-", so a project key may come as "tml-<key>"; a plain key works as well."""
    return f"Bearer {api_key.strip().removeprefix(TINKER_KEY_PREFIX)}"


def authenticate(reads: sessionmaker[Session], writes: sessionmaker[Session], authorization: str | None) -> Principal:
    key = bearer_key(authorization)
    with reads() as session:
        found = projects.active_key(session, key)
    if found is None:
        # Never echo the key: it may be a real secret pasted into the wrong place.
        raise Unauthenticated("invalid API key")
    api_key, project = found
    t = now()
    if api_key.last_used_at is None or api_key.last_used_at <= t - LAST_USED_RESOLUTION_S:
        with writes.begin() as session:
            projects.touch_key(session, api_key.id, t, older_than=t - LAST_USED_RESOLUTION_S)
    return Principal(project_id=project.id, project_name=project.name, key_id=api_key.id)


MAX_CACHED_KEYS = 10_000


@dataclass
class PrincipalCache:
    """sha256 of the Authorization header -> Principal for ttl_s, so each poll need not look its key up. Only found keys are kept:
    an unknown key always reaches the database. Used from the event loop only, so no lock."""

    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    _found: dict[str, tuple[float, Principal]] = field(default_factory=dict)  # digest -> (expires, principal)

    def get(self, authorization: str | None) -> Principal | None:
        if self.ttl_s <= 0 or not authorization:
            return None
        hit = self._found.get(projects.hash_key(authorization))
        return hit[1] if hit is not None and hit[0] > self.clock() else None

    def put(self, authorization: str, principal: Principal, looked_up_at: float) -> None:
        """Keep `principal` until ttl_s after `looked_up_at` (a clock() taken before the lookup began)."""
        if self.ttl_s <= 0:
            return
        if len(self._found) >= MAX_CACHED_KEYS:
            t = self.clock()
            self._found = {k: v for k, v in self._found.items() if v[0] > t}
        self._found[projects.hash_key(authorization)] = (looked_up_at + self.ttl_s, principal)
