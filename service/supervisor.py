"""A tiny process supervisor for `cispo up`: it runs the API and the worker as child processes,
restarts a worker that dies (with backoff), and on SIGTERM/SIGINT stops every child before it
exits, so no worker is left orphaned holding a job's lease.

The worker gets SIGTERM first and `grace_s` to finish: its warm shutdown checkpoints the running
job and queues it again (see worker/celery_app.py); only then is it killed.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30)
STABLE_AFTER_S = 60.0  # a child up this long has its restart backoff reset


@dataclass
class Child:
    name: str
    argv: list[str]
    restart: bool  # restart when it dies; otherwise its exit ends the supervisor
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    due: float = 0.0  # when a dead child may be started again
    history: list[int] = field(default_factory=list)  # pids, oldest first

    def start(self, env: dict | None) -> None:
        self.proc = subprocess.Popen(self.argv, env=env)
        self.started_at = time.monotonic()
        self.history.append(self.proc.pid)
        log.info("supervisor: started %s (pid %d)", self.name, self.proc.pid)


def supervise(children: list[Child], *, env: dict | None = None, grace_s: float = 60.0,
              poll_s: float = 0.5) -> int:
    """Run the children until a non-restarting one exits or a signal arrives; returns an exit code."""
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        for child in children:
            child.start(env)
        while not stop:
            time.sleep(poll_s)
            now = time.monotonic()
            for child in children:
                if child.proc is None:
                    if now >= child.due:
                        child.start(env)
                    continue
                rc = child.proc.poll()
                if rc is None:
                    continue
                if not child.restart:
                    log.warning("supervisor: %s exited with %s; stopping", child.name, rc)
                    code = rc or 0
                    stop.append(0)
                    break
                if now - child.started_at > STABLE_AFTER_S:
                    child.restarts = 0
                delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                child.restarts += 1
                child.proc, child.due = None, now + delay
                log.warning("supervisor: %s died (exit %s); restarting in %d s", child.name, rc, delay)
                print(f"cispo: {child.name} died (exit {rc}); restarting in {delay} s", flush=True)
    finally:
        _stop_all(children, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _stop_all(children: list[Child], grace_s: float) -> None:
    running = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("supervisor: pid %d did not stop within %.0f s; killing it", proc.pid, grace_s)
            proc.kill()
            proc.wait()
