"""Limits that keep one tenant from starving the others: the per-key request rate and the scoring caps.

RateLimit: a sustained rate with a burst allowance (a token bucket), one
bucket per API key. ScoringSlots: a cap on concurrent reward tests and
grader runs per project and in all, taken without waiting. Both answer 429
with Retry-After through TooManyRequests.

Two implementations of each, picked from the settings by `rate_limit` and
`scoring_slots`: with a Redis broker the counters live in Redis
(service/api/redis_limits.py), so N API replicas share one limit; the
embedded default (no Redis) keeps them in this process's memory (below),
where one event loop thread owns them and plain dicts need no lock. Both
implement the interfaces of service/api/limits.py, which is all either
imports of the other side. The per-project job quota is counted in SQL
instead (service/jobs.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from service.api.limits import SCORING, RateLimit, ScoringSlots, owner_full, rate_refused, total_full
from service.api.redis_limits import RedisSlots, RedisTokenBuckets
from service.settings import Settings

@dataclass
class TokenBuckets:
    rate_per_s: float
    burst: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (tokens, at)

    async def take(self, key: str) -> None:
        self.take_now(key)

    def take_now(self, key: str) -> None:
        t = self.clock()
        tokens, at = self._buckets.get(key, (float(self.burst), t))
        tokens = min(float(self.burst), tokens + (t - at) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, t)
            raise rate_refused(self.rate_per_s, self.burst, (1.0 - tokens) / self.rate_per_s)
        self._buckets[key] = (tokens - 1.0, t)


@dataclass
class Slots:
    """At most `per_owner` concurrent holders per owner and `total` in all; no queueing."""

    per_owner: int
    total: int
    what: str  # named in the 429 message, e.g. "reward tests"
    retry_after_s: float
    _held: dict[str, int] = field(default_factory=dict)

    def acquire(self, owner: str) -> None:
        held = self._held.get(owner, 0)
        if held >= self.per_owner:
            raise owner_full(self.what, held, self.retry_after_s)
        if sum(self._held.values()) >= self.total:
            raise total_full(self.what, self.total, self.retry_after_s)
        self._held[owner] = held + 1

    def release(self, owner: str) -> None:
        self._held[owner] -= 1
        if not self._held[owner]:
            del self._held[owner]

    @asynccontextmanager
    async def hold(self, owner: str) -> AsyncIterator[None]:
        self.acquire(owner)
        try:
            yield
        finally:
            self.release(owner)


def uses_redis(settings: Settings) -> bool:
    return settings.resolved_broker_url().startswith(("redis://", "rediss://"))


def rate_limit(settings: Settings) -> RateLimit:
    local = TokenBuckets(settings.rate_limit_per_s, settings.rate_limit_burst)
    if not uses_redis(settings):
        return local
    return RedisTokenBuckets(settings, fallback=local)


def scoring_slots(settings: Settings) -> ScoringSlots:
    local = Slots(per_owner=settings.scoring_per_project, total=settings.scoring_total, what=SCORING,
                  retry_after_s=min(settings.scoring_timeout_s, 30.0))
    if not uses_redis(settings):
        return local
    return RedisSlots(settings, fallback=local)
