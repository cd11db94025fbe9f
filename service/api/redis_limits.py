"""The rate limit and the scoring caps in Redis, shared by every API replica (see service/api/limits.py).

Each check is one Lua script, so the read-modify-write is atomic across
replicas, and it reads the clock from Redis (TIME), so replicas with skewed
clocks still agree. A scoring slot is a lease: a member of two sorted sets
(the project's and the global one) scored by its expiry. A holder releases
it when its scoring ends; a replica that dies holding one cannot, and the
lease lapses by itself LEASE_MARGIN_S after the scoring wall time, which no
live holder outlives (the scoring subprocess is stopped at it).

Redis down or slow: the check falls back to this replica's own in-process
limiter rather than refusing (fail-closed would turn a cache outage into an
API outage, while these limits protect fairness, not security) or letting
everything through (fail-open would drop the scoring cap that keeps user code
from swamping the API hosts). Each replica then enforces the per-process
limits, as before Redis held them. Every call is bounded by
`limits_timeout_s`, and after a failure Redis is left alone for
RETRY_REDIS_S, so an outage costs one short timeout, not one per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from anyio import CancelScope
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from service.api.limits import SCORING, RateLimit, ScoringSlots, owner_full, rate_refused, total_full
from service.settings import Settings

log = logging.getLogger(__name__)

RETRY_REDIS_S = 5.0
LEASE_MARGIN_S = 5.0  # beyond the scoring wall time: the database part before it, the subprocess's exit
PREFIX = "cispo:limits:"

# KEYS[1]: the key's bucket (a hash of tokens and when they were counted). ARGV: rate per s, burst.
# Returns the seconds until a token is there: "0" when one was spent. Floats go back as strings,
# since Redis truncates Lua numbers to integers.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(v[1]) or burst
local at = tonumber(v[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens < 1 then wait = (1 - tokens) / rate else tokens = tokens - 1 end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""

# KEYS[1]: the project's leases, KEYS[2]: all leases. ARGV: per project, total, lease ms, lease id.
# Returns {0, held} when taken, {1, held} when the project is full, {2, all} when the service is.
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[1]) then return {1, held} end
local all = redis.call('ZCARD', KEYS[2])
if all >= tonumber(ARGV[2]) then return {2, all} end
local ms = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + ms, ARGV[4])
redis.call('ZADD', KEYS[2], now + ms, ARGV[4])
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[2], ms)
return {0, held}
"""


class _Redis:
    """A client per event loop (asyncio connections belong to the loop that opened them), bounded calls,
    and the back-off after a failure."""

    def __init__(self, settings: Settings):
        self.url, self.timeout_s = settings.resolved_broker_url(), settings.limits_timeout_s
        # One deployment is one database: stacks that share a Redis database keep apart limits (the URL is hashed,
        # so no password reaches a key name).
        self.prefix = f"{PREFIX}{hashlib.sha256(settings.resolved_database_url().encode()).hexdigest()[:12]}:"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Redis | None = None
        self._down_until = 0.0

    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, exc: BaseException) -> None:
        log.warning("limits: Redis failed (%s: %s); this replica's own limits apply for %g s",
                    type(exc).__name__, exc, RETRY_REDIS_S)
        self._down_until = time.monotonic() + RETRY_REDIS_S

    async def eval(self, script: str, keys: list[str], args: list) -> object:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            # No retries: a retry is another timeout the request waits for; the fallback answers instead.
            self._client = Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                          socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0))
        # wait_for bounds the whole call (pool wait, EVALSHA, a NOSCRIPT reload), not just each socket op.
        return await asyncio.wait_for(self._client.eval(script, len(keys), *keys, *args), self.timeout_s * 2)


REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


class RedisTokenBuckets:
    def __init__(self, settings: Settings, *, fallback: RateLimit):
        self.rate_per_s, self.burst = settings.rate_limit_per_s, settings.rate_limit_burst
        self.redis, self.fallback = _Redis(settings), fallback

    async def take(self, key: str) -> None:
        if self.redis.up():
            try:
                wait = float(await self.redis.eval(TAKE, [f"{self.redis.prefix}rate:{key}"], [self.rate_per_s, self.burst]))
            except REDIS_ERRORS as exc:
                self.redis.failed(exc)
            else:
                if wait > 0:
                    raise rate_refused(self.rate_per_s, self.burst, wait)
                return
        await self.fallback.take(key)


class RedisSlots:
    def __init__(self, settings: Settings, *, fallback: ScoringSlots):
        self.per_owner, self.total = settings.scoring_per_project, settings.scoring_total
        self.lease_ms = int((settings.scoring_timeout_s + LEASE_MARGIN_S) * 1000)
        self.retry_after_s = fallback.retry_after_s
        self.redis, self.fallback = _Redis(settings), fallback

    def _keys(self, owner: str) -> list[str]:
        # One hash tag: both sets land in one Redis Cluster slot, as a multi-key script needs.
        prefix = self.redis.prefix
        return [f"{prefix}{{scoring}}:project:{owner}", f"{prefix}{{scoring}}:all"]

    async def _acquire(self, owner: str) -> str | None:
        """The lease id, or None when Redis failed (the caller falls back)."""
        lease = secrets.token_hex(8)
        try:
            taken, count = await self.redis.eval(ACQUIRE, self._keys(owner),
                                                 [self.per_owner, self.total, self.lease_ms, lease])
        except REDIS_ERRORS as exc:
            self.redis.failed(exc)
            return None
        if taken == 1:
            raise owner_full(SCORING, count, self.retry_after_s)
        if taken == 2:
            raise total_full(SCORING, self.total, self.retry_after_s)
        return lease

    async def _release(self, owner: str, lease: str) -> None:
        try:
            await self.redis.eval("redis.call('ZREM', KEYS[1], ARGV[1]) return redis.call('ZREM', KEYS[2], ARGV[1])",
                                  self._keys(owner), [lease])
        except REDIS_ERRORS as exc:
            self.redis.failed(exc)  # the lease lapses by itself

    @asynccontextmanager
    async def hold(self, owner: str) -> AsyncIterator[None]:
        lease = await self._acquire(owner) if self.redis.up() else None
        if lease is None:
            async with self.fallback.hold(owner):
                yield
            return
        try:
            yield
        finally:
            with CancelScope(shield=True):  # a client that hung up still gives its slot back
                await self._release(owner, lease)
