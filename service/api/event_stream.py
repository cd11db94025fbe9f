"""A job's events as server-sent events (text/event-stream), oldest first, until the job ends.

Each poll opens a session, reads the events after the cursor and the job's
status, and closes it, so an open stream holds no database connection
between polls; the polls run in the thread pool and the waits are async
sleeps, so a thousand idle streams hold no threads either. Every message
carries the event's id, and a client that reconnects with Last-Event-ID (as
EventSource does by itself) resumes right after it. The stream ends with an
`end` message once the job is terminal and every event is sent, and closes
after MAX_STREAM_S in any case (the client reconnects and resumes).
Hand-written, not sse-starlette: the framing is one f-string, and the loop's point is its session-per-poll
and resume rules, which a library's generator wrapper would not change.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import Request
from sqlalchemy.orm import Session, sessionmaker

from service.api.presenters import event as present_event
from service.db.models import JobEvent
from service.repositories.job_outputs import events_since
from service.repositories.jobs import TERMINAL

POLL_S = 1.0
KEEPALIVE_S = 15.0
MAX_STREAM_S = 600.0
BATCH = 100
RETRY_MS = 2000


def message(data: dict, *, event: str, id: str | None = None) -> str:
    lines = [f"id: {id}"] if id else []
    lines += [f"event: {event}", f"data: {json.dumps(data, separators=(',', ':'))}"]
    return "\n".join(lines) + "\n\n"


def _poll(sessions: sessionmaker[Session], job_id: str, after_seq: int, include_metrics: bool
          ) -> tuple[str | None, list[JobEvent]]:
    with sessions() as s:  # closed before the next wait: no connection is held between polls
        return events_since(s, job_id, after_seq, include_metrics=include_metrics, limit=BATCH)


async def stream(request: Request, sessions: sessionmaker[Session], job_id: str, *, after_seq: int,
                 include_metrics: bool) -> AsyncIterator[str]:
    started = last_sent = time.monotonic()
    yield f"retry: {RETRY_MS}\n\n"
    while time.monotonic() - started < MAX_STREAM_S:
        if await request.is_disconnected():
            return
        status, events = await anyio.to_thread.run_sync(_poll, sessions, job_id, after_seq, include_metrics)
        for row in events:
            after_seq = row.seq
            yield message(present_event(row).model_dump(mode="json"), event="fine_tuning.job.event", id=row.id)
            last_sent = time.monotonic()
        if len(events) == BATCH:
            continue  # more are waiting
        if status in TERMINAL or status is None:
            yield message({"status": status}, event="end")
            return
        if time.monotonic() - last_sent >= KEEPALIVE_S:
            yield ": keep-alive\n\n"  # a comment: keeps proxies from closing an idle stream
            last_sent = time.monotonic()
        await asyncio.sleep(POLL_S)
