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

A job and its event pages read as one snapshot: an events page is served only
if its load began after the job's newest load ended. The worker commits a
job's last event with its terminal status, so a client that saw the job end
(or any status) and then asks for its events gets every event up to that
status, never an older cached page (`cispo jobs logs --follow` and SDK pollers
stop on that).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from anyio import to_thread

MAX_JOBS = 10_000  # entries are tiny, but a scan of many job ids must not grow the process without bound
JOB = "job"  # the variant that holds the job itself (its status); every other variant is read against it


class PollCache:
    """Used from the event loop only (a sync route calls forget through anyio.from_thread), so no lock."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        # job -> variant -> (expires, when its load began (a tick), body)
        self._entries: dict[tuple[str, str], dict[Hashable, tuple[float, int, bytes]]] = {}
        self._forgotten: dict[tuple[str, str], float] = {}  # job -> when a control action last changed it
        # Ticks order loads on the event loop (clock readings can tie): job -> the tick its newest JOB load ended.
        self._tick = 0
        self._job_read: dict[tuple[str, str], int] = {}

    async def get(self, project_id: str, job_id: str, variant: Hashable, load: Callable[[], bytes]) -> bytes:
        """The cached body, or `load()` run in the threadpool (and kept for ttl_s from when it began)."""
        job = (project_id, job_id)
        started = self.clock()
        hit = self._entries.get(job, {}).get(variant)
        if hit is not None and hit[0] > started and (variant == JOB or hit[1] > self._job_read.get(job, -1)):
            return hit[2]
        self._tick += 1
        began = self._tick
        body = await to_thread.run_sync(load)
        self._tick += 1
        if variant == JOB:
            if len(self._job_read) >= MAX_JOBS:
                self._evict()
            self._job_read[job] = self._tick
        if self.ttl_s > 0 and self._forgotten.get(job, float("-inf")) < started:
            if len(self._entries) >= MAX_JOBS:
                self._evict()
            self._entries.setdefault(job, {})[variant] = (started + self.ttl_s, began, body)
        return body

    def forget(self, project_id: str, job_id: str) -> None:
        """The job changed here: drop its entries, and do not store a load that began before now."""
        job = (project_id, job_id)
        if len(self._forgotten) >= MAX_JOBS:
            self._evict()
        self._forgotten[job] = self.clock()
        self._entries.pop(job, None)
        self._job_read.pop(job, None)

    def _evict(self) -> None:
        """Drop expired entries. A job's read mark goes with its entries: a page loaded later is newer anyway."""
        t = self.clock()
        for job, variants in list(self._entries.items()):
            if all(expires <= t for expires, _, _ in variants.values()):
                self._entries.pop(job, None)
        for job in [j for j in self._job_read if j not in self._entries]:
            self._job_read.pop(job)
        for job, at in list(self._forgotten.items()):
            if at + self.ttl_s <= t:
                self._forgotten.pop(job, None)
        if len(self._entries) >= MAX_JOBS or len(self._job_read) >= MAX_JOBS:
            self._entries.clear()
            self._job_read.clear()
