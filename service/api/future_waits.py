"""Held retrieve_future polls (service/api/routes/tinker.py), woken when their request rows end.

A training loop keeps a few futures waiting at any time, a sampling loop hundreds. Each waiting poll reading its
own row in growing steps would cost a query per poll per step and answer late by up to a step; instead one task
per event loop reads, every `interval_s`, which of all the rows waited on have ended (one query, however many
waiters), and wakes those. The task runs only while someone waits. Runners live in other processes, so the row
in SQL is the only signal there is; the interval bounds the added latency.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi.concurrency import run_in_threadpool

log = logging.getLogger(__name__)


class FutureWaits:
    def __init__(self, ended_among: Callable[[list[str]], set[str]], *, interval_s: float = 0.05,
                 first_interval_s: float = 0.005, growth: float = 0.1):
        """`ended_among(ids)`: which of the request ids have ended (a blocking read; run in the threadpool)."""
        self.ended_among, self.interval_s = ended_among, interval_s
        self.first_interval_s, self.growth = min(first_interval_s, interval_s), growth
        # Per event loop: a TestClient, like each uvicorn worker, runs the app in a loop of its own.
        self._waiters: dict[asyncio.AbstractEventLoop, dict[str, list[asyncio.Event]]] = {}
        self._started: dict[asyncio.AbstractEventLoop, dict[asyncio.Event, float]] = {}  # each waiter's start
        self._pollers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}

    async def wait(self, request_id: str, timeout_s: float) -> bool:
        """Wait until the request has ended (True) or `timeout_s` passed (False)."""
        loop = asyncio.get_running_loop()
        waiters = self._waiters.setdefault(loop, {})
        started = self._started.setdefault(loop, {})
        event = asyncio.Event()
        waiters.setdefault(request_id, []).append(event)
        started[event] = loop.time()
        if loop not in self._pollers or self._pollers[loop].done():
            self._pollers[loop] = loop.create_task(self._poll(loop))
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            started.pop(event, None)
            events = waiters.get(request_id, [])
            if event in events:
                events.remove(event)
            if not events:
                waiters.pop(request_id, None)

    def _delay(self, loop: asyncio.AbstractEventLoop, last_read_s: float) -> float:
        started = self._started.get(loop)
        if not started:
            return self.interval_s
        return self.next_delay(loop.time() - max(started.values()), last_read_s)

    def next_delay(self, youngest_waited_s: float, last_read_s: float) -> float:
        """Until the next pass: `growth` times the youngest waiter's wait so far, within the two intervals, and
        no less than nine times the last read (so reading takes at most a tenth of the database's time)."""
        return min(self.interval_s, max(self.first_interval_s, self.growth * youngest_waited_s, 9 * last_read_s))

    async def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        waiters = self._waiters[loop]
        last_read_s = 0.0
        while waiters:
            await asyncio.sleep(self._delay(loop, last_read_s))
            ids = list(waiters)
            if not ids:
                break
            reading = loop.time()
            try:
                ended = await run_in_threadpool(self.ended_among, ids)
            except Exception:  # a database hiccup: the next pass reads again; the waiters' timeouts bound it
                log.warning("reading which Tinker requests ended failed; reading again", exc_info=True)
                continue
            finally:
                last_read_s = loop.time() - reading
            for request_id in ended:
                for event in waiters.get(request_id, []):
                    event.set()
