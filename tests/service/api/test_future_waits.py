"""Held retrieve_future polls share one reader (service/api/future_waits.py): many waiters cost one query per
interval, each is woken once its request ends, and the rest time out."""

from __future__ import annotations

import asyncio
import threading
import time

from service.api.future_waits import FutureWaits


def test_many_waiters_share_one_read_per_interval_and_wake_when_their_request_ends():
    ended: set[str] = set()
    reads: list[int] = []
    lock = threading.Lock()

    def ended_among(ids: list[str]) -> set[str]:
        with lock:
            reads.append(len(ids))
            return ended & set(ids)

    waits = FutureWaits(ended_among, interval_s=0.05)

    async def main():
        async def end_later():
            await asyncio.sleep(0.3)
            with lock:
                ended.update(f"r{i}" for i in range(0, 100, 2))

        asyncio.get_running_loop().create_task(end_later())
        started = time.monotonic()
        results = await asyncio.gather(*(waits.wait(f"r{i}", 1.0) for i in range(100)))
        return results, time.monotonic() - started

    results, took = asyncio.run(main())
    assert results == [i % 2 == 0 for i in range(100)]  # the ended woke, the others timed out
    assert took < 2.0
    assert max(reads) == 100 and len(reads) <= 1.0 / 0.05 + 5  # one read per interval for all hundred
