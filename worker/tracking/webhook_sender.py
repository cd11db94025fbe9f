"""Runs the webhook outbox (service/webhooks.py) in a worker: a pass every few seconds in a daemon thread.

Every worker runs one; two senders never send the same delivery at once (each attempt is claimed in SQL).
"""

from __future__ import annotations

import logging
import threading

from service.db.session import session_factory
from service.egress import EgressPolicy
from service.settings import Settings
from service.webhooks import dispatch_once

log = logging.getLogger(__name__)


def start(settings: Settings, interval_s: float = 5.0) -> threading.Event:
    """Set the returned event to stop."""
    stop = threading.Event()
    sessions = session_factory(settings.resolved_database_url())
    policy = EgressPolicy.from_setting(settings.egress_allow)

    def loop():
        while not stop.wait(interval_s):
            try:
                dispatch_once(sessions, policy)
            except Exception:
                log.exception("webhook pass failed")

    threading.Thread(target=loop, name="webhooks", daemon=True).start()
    return stop
