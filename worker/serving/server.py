"""The serving loop: requests taken from this worker's queues and decoded together, step by step.

A thread takes requests from the queues (a few ahead of the decoder, so an
idle worker beside this one still gets its share) and hands them over; the
loop admits them between decode steps and runs one step of every base's
running batch at a time (worker/serving/scheduler.py), so requests of many
tenants and adapters share each forward. A caller that hung up has its rows
dropped at the next step: every running request's cancel mark is looked at
in one round trip a step.

`cispo serve --model BASE` (repeatable) loads those bases at start and takes
only their queues; `cispo serve` with no model takes the any-base queue and
loads the base a request names, keeping the last one resident: a request
for another base waits until the running batch is done (and the requests
taken after it wait with it, in order), then the base switches. Presence keys, refreshed by a thread, tell the API which queues
have a worker. Nothing the worker is sent runs as code: requests carry
text, sampling numbers, and a checkpoint the API resolved for the caller's
project.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from service.serving.channel import ANY_BASE, Channel, cancel_key, open_channel, presence_key, request_queue
from service.settings import Settings
from service.storage import open_store
from worker.scratch import beside_jobs

log = logging.getLogger(__name__)

PRESENCE_TTL_S = 10.0
PRESENCE_EVERY_S = 2.0
POLL_S = 1.0  # how long one wait for a request lasts: the bound on noticing a stop
TAKEN_AHEAD = 4  # requests taken off the queues and not yet admitted, at most
MAX_ROWS = 64  # rows waiting for room in the batches, at most, before more requests are admitted


class ServingWorker:
    def __init__(self, settings: Settings, bases: list[str], channel: Channel | None = None):
        self.settings, self.bases = settings, list(bases)
        self.channel = channel or open_channel(settings)
        self.store = open_store(settings.resolved_storage_url())
        self.scratch = beside_jobs(settings, "serve")
        self.residents: dict = {}
        self.schedulers: dict = {}  # base -> its Scheduler (worker/serving/scheduler.py)
        self.held: deque[dict] = deque()  # any-base requests for another base than the resident one
        self.taken: queue.Queue[dict] = queue.Queue(maxsize=TAKEN_AHEAD)
        self.outbox: list[tuple[str, dict]] = []  # (reply list, message) to send at the end of the admission or step
        self.stop = threading.Event()
        names = self.bases or [ANY_BASE]
        self.queues = [request_queue(b) for b in names]
        self.presence = [presence_key(b) for b in names]

    def run(self) -> None:
        for base in self.bases:
            self._scheduler(base)
        threading.Thread(target=self._announce, daemon=True, name="serve-presence").start()
        intake = threading.Thread(target=self._take, daemon=True, name="serve-intake")
        intake.start()
        log.info("serving %s", ", ".join(self.bases) or "any base")
        while not self.stop.is_set() or intake.is_alive() or not self.taken.empty() or self._busy():
            self._admit(wait=not self._busy())
            self._flush()
            for scheduler in list(self.schedulers.values()):
                if scheduler.busy:
                    self._step(scheduler)
                    self._flush()
        for key in self.presence:  # gone now, not in PRESENCE_TTL_S: the API stops routing here at once
            self.channel.mark_alive(key, 0.001)

    def _take(self) -> None:
        """Take requests off the queues while the decoder keeps up (at most TAKEN_AHEAD not yet admitted)."""
        while not self.stop.is_set():
            try:
                got = self.channel.pop(self.queues, POLL_S)
            except Exception:
                log.exception("serving: could not take a request")
                self.stop.wait(POLL_S)
                continue
            if got is not None:
                self.taken.put(got[1])

    def _busy(self) -> bool:
        return bool(self.held) or any(s.busy for s in self.schedulers.values())

    def _admit(self, *, wait: bool) -> None:
        """Admit what was taken (waiting up to POLL_S for something when idle), while the rows waiting for room in
        the batches stay under a batch's worth; any-base requests held for another base once the batch is done."""
        if self.held and not any(s.busy for s in self.schedulers.values()):
            held, self.held = list(self.held), deque()
            for request in held:
                self.handle(request, accepted=True)
        while sum(s.waiting_rows() for s in self.schedulers.values()) < MAX_ROWS:
            try:
                request = self.taken.get(timeout=POLL_S) if wait else self.taken.get_nowait()
            except queue.Empty:
                return
            wait = False
            self.handle(request)

    def _announce(self) -> None:
        while not self.stop.is_set():
            for key in self.presence:
                try:
                    self.channel.mark_alive(key, PRESENCE_TTL_S)
                except Exception:
                    log.exception("serving: could not announce presence on %s", key)
            self.stop.wait(PRESENCE_EVERY_S)

    def _scheduler(self, base: str):
        from worker.serving.engine import ResidentModel
        from worker.serving.scheduler import Scheduler

        if base not in self.residents:
            if not self.bases:  # an any-base worker keeps one base in memory
                self.residents.clear()
                self.schedulers.clear()
            self.residents[base] = ResidentModel(base, store=self.store, scratch=self.scratch,
                                                 max_adapters=self.settings.serve_adapters_cached)
        if base not in self.schedulers:
            self.schedulers[base] = Scheduler(self.residents[base], looks=self._gone, said=self._flush)
        return self.schedulers[base]

    def _gone(self, keys: list[str]) -> list[bool]:
        """Whose callers hung up, for every running request's cancel mark in one round trip."""
        try:
            return self.channel.alive_many(keys)
        except Exception:
            log.exception("serving: could not look at the cancel marks")
            return [False] * len(keys)

    def _sender(self, reply: str):
        def send(**message) -> None:
            self.outbox.append((reply, message))
        return send

    def _flush(self) -> None:
        """Send what the last admission or decode step said, every reply's messages in one round trip."""
        if self.outbox:
            messages, self.outbox = self.outbox, []
            try:
                self.channel.push_many(messages, ttl_s=self.settings.serve_reply_timeout_s + 60)
            except Exception:
                log.exception("serving: could not send %d reply messages", len(messages))

    def handle(self, request: dict, *, accepted: bool = False) -> None:
        """Admit one request into its base's batch (or hold it for a base switch); the decoding is `run`'s."""
        reply = request["reply"]
        send = self._sender(reply)
        if not accepted:
            if time.time() > request["deadline"]:
                log.warning("serving: dropped a request whose caller gave up waiting for a worker")
                return
            send(type="accepted")
            self._flush()  # before its adapter may have to be fetched: the API waits for this a short while only
        base = request["target"]["base"]
        if not self.bases and (self.held or base not in self.schedulers and self._busy()):
            self.held.append(request)  # in order: requests for the resident base do not overtake it for ever
            return
        try:
            self._scheduler(base).add(request, send, cancel_key=cancel_key(reply), name=reply)
        except Exception as e:
            log.exception("serving: request failed")
            send(type="error", status=500, message=f"the serving worker failed: {type(e).__name__}: {e}",
                 code="serving_error")

    def _step(self, scheduler) -> None:
        try:
            ended = scheduler.step()
        except Exception as e:
            log.exception("serving: a decode step failed")
            ended = scheduler.fail_all(f"the serving worker failed: {type(e).__name__}: {e}")
        for flight in ended:
            if flight.cancelled:
                log.info("serving: %s: its caller hung up; stopped after %d tokens", flight.name,
                         flight.decoded)


def serve(settings: Settings, bases: list[str]) -> int:
    import signal

    worker = ServingWorker(settings, bases)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop.set())
    worker.run()
    return 0
