"""The serving loop: take a request from this worker's queues, answer it on its reply list, one at a time.

`cispo serve --model BASE` (repeatable) loads those bases at start and takes
only their queues; `cispo serve` with no model takes the any-base queue and
loads the base a request names, keeping the last one resident. Presence keys,
refreshed by a thread, tell the API which queues have a worker. Nothing
the worker is sent runs as code: requests carry text, sampling numbers, and
a checkpoint the API resolved for the caller's project.
"""

from __future__ import annotations

import logging
import threading
import time

from service.serving.channel import ANY_BASE, Channel, cancel_key, open_channel, presence_key, request_queue
from service.settings import Settings
from service.storage import open_store
from worker.scratch import beside_jobs

log = logging.getLogger(__name__)

PRESENCE_TTL_S = 10.0
PRESENCE_EVERY_S = 2.0
POLL_S = 1.0  # how long one wait for a request lasts: the bound on noticing a stop


class ServingWorker:
    def __init__(self, settings: Settings, bases: list[str], channel: Channel | None = None):
        self.settings, self.bases = settings, list(bases)
        self.channel = channel or open_channel(settings)
        self.store = open_store(settings.resolved_storage_url())
        self.scratch = beside_jobs(settings, "serve")
        self.residents: dict = {}
        self.stop = threading.Event()
        names = self.bases or [ANY_BASE]
        self.queues = [request_queue(b) for b in names]
        self.presence = [presence_key(b) for b in names]

    def run(self) -> None:
        for base in self.bases:
            self._resident(base)
        threading.Thread(target=self._announce, daemon=True, name="serve-presence").start()
        log.info("serving %s", ", ".join(self.bases) or "any base")
        while not self.stop.is_set():
            got = self.channel.pop(self.queues, POLL_S)
            if got is not None:
                self.handle(got[1])
        for key in self.presence:  # gone now, not in PRESENCE_TTL_S: the API stops routing here at once
            self.channel.mark_alive(key, 0.001)

    def _announce(self) -> None:
        while not self.stop.is_set():
            for key in self.presence:
                try:
                    self.channel.mark_alive(key, PRESENCE_TTL_S)
                except Exception:
                    log.exception("serving: could not announce presence on %s", key)
            self.stop.wait(PRESENCE_EVERY_S)

    def _resident(self, base: str):
        from worker.serving.engine import ResidentModel

        if base not in self.residents:
            if not self.bases:
                self.residents.clear()  # an any-base worker keeps one base in memory
            self.residents[base] = ResidentModel(base, store=self.store, scratch=self.scratch,
                                                 max_adapters=self.settings.serve_adapters_cached)
        return self.residents[base]

    def handle(self, request: dict) -> None:
        reply = request["reply"]
        ttl = self.settings.serve_reply_timeout_s + 60

        def send(**message) -> None:
            self.channel.push(reply, message, ttl_s=ttl)

        if time.time() > request["deadline"]:
            log.warning("serving: dropped a request whose caller gave up waiting for a worker")
            return
        send(type="accepted")
        from worker.serving.answer import Cancelled, answer

        try:
            answer(self._resident(request["target"]["base"]), request, send,
                   cancelled=lambda: self.channel.alive(cancel_key(reply)))
        except Cancelled as e:
            log.info("serving: %s: its caller hung up; stopped %s", reply, e)
            return
        except Exception as e:
            log.exception("serving: request failed")
            send(type="error", status=500, message=f"the serving worker failed: {type(e).__name__}: {e}",
                 code="serving_error")
            return
        send(type="end")


def serve(settings: Settings, bases: list[str]) -> int:
    import signal

    worker = ServingWorker(settings, bases)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop.set())
    worker.run()
    return 0
