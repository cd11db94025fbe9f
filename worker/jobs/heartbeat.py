"""A lease renewed in the background: a daemon thread calls `beat` every `every_s` seconds until stopped.

A beat that raises (a database blip) is logged and the next one tries again; losing the lease is the beat's
own business to record (it sees its renewal refused). A job's reporter (worker/jobs/job_reporter.py) and an eval
run (worker/jobs/eval_runner.py) each renew theirs with one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, beat: Callable[[], None], every_s: float, name: str):
        self.beat, self.every_s = beat, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except Exception:  # a transient database error: the next beat retries
                log.exception("%s: the lease renewal failed", self._thread.name)
