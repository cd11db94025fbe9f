"""A short-lived cache of what clients poll: a job, and a page of its events, as response bytes.

Hundreds of clients polling one job every second would each cost a database
round trip, a pydantic model and its JSON; with this cache they cost one of
each per job and page per `ttl_s` (at most a second) in this API process.

Entries are keyed by project first: an entry is only ever read back under
the project whose principal loaded it, so another project asking for the
same job id misses and gets the route's own 404. Failures (a 404) are not
cached. A cancel / pause / resume through this process forgets the job's
entries at once, and a load that raced it is not stored; what the worker or
another replica changes shows within `ttl_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from anyio import to_thread

MAX_JOBS = 10_000  # entries are tiny, but a scan of many job ids must not grow the process without bound


class PollCache:
    """Used from the event loop only (a sync route calls forget through anyio.from_thread), so no lock."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._entries: dict[tuple[str, str], dict[Hashable, tuple[float, bytes]]] = {}  # job -> variant -> (expires, body)
        self._forgotten: dict[tuple[str, str], float] = {}  # job -> when a control action last changed it

    async def get(self, project_id: str, job_id: str, variant: Hashable, load: Callable[[], bytes]) -> bytes:
        """The cached body, or `load()` run in the threadpool (and kept for ttl_s from when it began)."""
        job = (project_id, job_id)
        started = self.clock()
        hit = self._entries.get(job, {}).get(variant)
        if hit is not None and hit[0] > started:
            return hit[1]
        body = await to_thread.run_sync(load)
        if self.ttl_s > 0 and self._forgotten.get(job, float("-inf")) < started:
            if len(self._entries) >= MAX_JOBS:
                self._evict()
            self._entries.setdefault(job, {})[variant] = (started + self.ttl_s, body)
        return body

    def forget(self, project_id: str, job_id: str) -> None:
        """The job changed here: drop its entries, and do not store a load that began before now."""
        job = (project_id, job_id)
        if len(self._forgotten) >= MAX_JOBS:
            self._evict()
        self._forgotten[job] = self.clock()
        self._entries.pop(job, None)

    def _evict(self) -> None:
        t = self.clock()
        for job, variants in list(self._entries.items()):
            if all(expires <= t for expires, _ in variants.values()):
                self._entries.pop(job, None)
        for job, at in list(self._forgotten.items()):
            if at + self.ttl_s <= t:
                self._forgotten.pop(job, None)
        if len(self._entries) >= MAX_JOBS:
            self._entries.clear()
