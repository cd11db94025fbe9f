"""Limits that keep one tenant from starving the others, in this API process's memory.

TokenBuckets: a sustained rate with a burst allowance, one bucket per key
(requests per API key). Slots: a cap on concurrent work per project and in
all, taken without waiting (reward tests, grader runs). Both answer 429
with Retry-After through TooManyRequests. They live in one event loop
thread, so plain dicts need no lock. A deployment with N API replicas
allows N times the rates; the per-project job quota, which must hold
across replicas, is counted in SQL instead (service/jobs.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from service.errors import TooManyRequests


@dataclass
class TokenBuckets:
    rate_per_s: float
    burst: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (tokens, at)

    def take(self, key: str) -> None:
        """Spend one token of `key`'s bucket, or raise TooManyRequests saying when one will be there."""
        t = self.clock()
        tokens, at = self._buckets.get(key, (float(self.burst), t))
        tokens = min(float(self.burst), tokens + (t - at) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, t)
            raise TooManyRequests(f"rate limit: this API key may send {self.rate_per_s:g} requests per second "
                                  f"(bursts of {self.burst}); retry later",
                                  retry_after_s=(1.0 - tokens) / self.rate_per_s)
        self._buckets[key] = (tokens - 1.0, t)


@dataclass
class Slots:
    """At most `per_owner` concurrent holders per owner and `total` in all; no queueing."""

    per_owner: int
    total: int
    what: str  # named in the 429 message, e.g. "reward tests"
    retry_after_s: float
    _held: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def hold(self, owner: str) -> Iterator[None]:
        held = self._held.get(owner, 0)
        if held >= self.per_owner:
            raise TooManyRequests(f"{self.what}: this project already runs {held} at once (the limit); retry "
                                  "when one has finished", retry_after_s=self.retry_after_s,
                                  code="concurrency_limit_exceeded")
        if sum(self._held.values()) >= self.total:
            raise TooManyRequests(f"{self.what}: the service runs its limit of {self.total} at once; retry "
                                  "shortly", retry_after_s=self.retry_after_s, code="concurrency_limit_exceeded")
        self._held[owner] = held + 1
        try:
            yield
        finally:
            self._held[owner] -= 1
            if not self._held[owner]:
                del self._held[owner]
