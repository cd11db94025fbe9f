"""The chat and completion requests one API process is waiting on serving workers for.

Each wait reads the serving channel, a blocking call, on a thread. Those threads come from a pool of their own
(`serve_max_waiting`), never from the one the API's other routes run on: a hundred chats waiting for a busy
worker would otherwise hold every thread, and another tenant's `GET /v1/fine_tuning/jobs` would wait behind
them. One project may hold at most `serve_max_waiting_per_project` of those waits; one more is a 429, so one
tenant's burst leaves room for the others.
"""

from __future__ import annotations

from collections import Counter

from anyio import CapacityLimiter, to_thread

from service.errors import TooManyRequests

RETRY_AFTER_S = 1


class ServingWaits:
    def __init__(self, total: int, per_project: int):
        self.total, self.per_project = total, per_project
        self.held: Counter[str] = Counter()
        self._limiter: CapacityLimiter | None = None  # made in the event loop, on first use

    def hold(self, project_id: str) -> None:
        """Take a place for one request of `project_id` (release it when its reply has ended), or a 429."""
        if self.held[project_id] >= self.per_project:
            raise TooManyRequests(f"this project already has {self.held[project_id]} chat or completion requests "
                                  f"waiting on the serving workers, its limit (CISPO_SERVE_MAX_WAITING_PER_PROJECT="
                                  f"{self.per_project}); retry once some have been answered",
                                  retry_after_s=RETRY_AFTER_S, code="serving_quota_exceeded")
        if sum(self.held.values()) >= self.total:
            raise TooManyRequests(f"this API process already waits on {self.total} chat or completion requests "
                                  "(CISPO_SERVE_MAX_WAITING); retry shortly", retry_after_s=RETRY_AFTER_S,
                                  code="serving_busy")
        self.held[project_id] += 1

    def release(self, project_id: str) -> None:
        self.held[project_id] -= 1
        if self.held[project_id] <= 0:
            del self.held[project_id]

    async def run(self, fn, *args):
        """fn(*args) on a serving thread; a cancelled caller (a client that hung up) does not wait for it."""
        if self._limiter is None:
            self._limiter = CapacityLimiter(self.total)
        return await to_thread.run_sync(fn, *args, limiter=self._limiter, abandon_on_cancel=True)
