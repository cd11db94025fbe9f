"""One request answered alone: its choices decoded together in a batch of their own (scheduler.py).

The serving worker itself batches every request it holds (server.py); this is
that path for a single request, which tests and tools use as the reference a
request decoded alone gives.
"""

from __future__ import annotations

from collections.abc import Callable

from worker.serving.engine import ResidentModel
from worker.serving.scheduler import Scheduler


class Cancelled(Exception):
    """The caller hung up: nothing more of this request is decoded."""


def answer(resident: ResidentModel, request: dict, send: Callable[..., None],
           cancelled: Callable[[], bool] = lambda: False) -> None:
    """Decode the request's choices together, looking once a decode step whether its caller is gone; raises
    Cancelled (naming the tokens decoded so far) when it is."""
    scheduler = Scheduler(resident, looks=lambda keys: [cancelled() for _ in keys])
    if scheduler.add(request, send, cancel_key="caller") is None:
        return
    while scheduler.busy:
        for ended in scheduler.step():
            if ended.cancelled:
                raise Cancelled(f"after {ended.decoded} tokens")
