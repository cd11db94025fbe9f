"""What a request-rate limit and a scoring cap are, and the 429s they answer; no implementation.

The in-process implementations (service/api/ratelimit.py) and the Redis ones
shared by every replica (service/api/redis_limits.py) both depend on this
module, never on each other's internals; ratelimit.py picks one from the settings.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

from service.errors import TooManyRequests

SCORING = "reward tests and grader runs"  # named in the scoring 429s


class RateLimit(Protocol):
    async def take(self, key: str) -> None:
        """Spend one of `key`'s requests, or raise TooManyRequests saying when the next one is allowed."""


class ScoringSlots(Protocol):
    retry_after_s: float  # what the 429 tells the client to wait

    def hold(self, owner: str) -> AbstractAsyncContextManager[None]:
        """Hold one of `owner`'s slots for the block, or raise TooManyRequests at once."""


def rate_refused(rate_per_s: float, burst: int, retry_after_s: float) -> TooManyRequests:
    return TooManyRequests(f"rate limit: this API key may send {rate_per_s:g} requests per second "
                           f"(bursts of {burst}); retry later", retry_after_s=retry_after_s)


def owner_full(what: str, held: int, retry_after_s: float) -> TooManyRequests:
    return TooManyRequests(f"{what}: this project already runs {held} at once (the limit); retry when one has "
                           "finished", retry_after_s=retry_after_s, code="concurrency_limit_exceeded")


def total_full(what: str, total: int, retry_after_s: float) -> TooManyRequests:
    return TooManyRequests(f"{what}: the service runs its limit of {total} at once; retry shortly",
                           retry_after_s=retry_after_s, code="concurrency_limit_exceeded")
