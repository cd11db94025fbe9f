"""A tiny process supervisor for `cispo up`: it runs the API and the worker as child processes,
restarts a worker that dies (with backoff), and on SIGTERM/SIGINT stops every child before it
exits, so no worker is left orphaned holding a job's lease.

Each child gets SIGTERM first and `grace_s` to finish: the worker's warm shutdown checkpoints the
running job and queues it again (see worker/celery_app.py), an idle one exits in about a second.
A second SIGTERM/SIGINT (Ctrl-C twice), or the grace running out, kills them at once. Whatever a
child started and left behind (pool children, training ranks, sandboxes; seen in /proc while
stopping) is killed before `cispo up` returns, so nothing outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

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
              poll_s: float = 0.25) -> int:
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
        _stop_all(children, grace_s, stop, poll_s=min(poll_s, 0.1))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _stop_all(children: list[Child], grace_s: float, signals: list[int], *, poll_s: float) -> None:
    """SIGTERM every running child and wait up to grace_s; kill them (and all they started) after
    that, or as soon as another signal arrives; then kill any descendant still left."""
    running = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    if signals and signals[0] and running:
        print("cispo: stopping; a running job checkpoints at its next step (signal again to stop at once)",
              flush=True)
    seen = {}  # pid -> start time of every descendant met while stopping
    for proc in running:
        seen.update(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
    signalled, deadline = len(signals), time.monotonic() + grace_s
    while any(p.poll() is None for p in running):
        if len(signals) > signalled or time.monotonic() >= deadline:
            why = "another signal" if len(signals) > signalled else f"no exit within {grace_s:.0f} s"
            log.warning("supervisor: killing the children (%s)", why)
            print(f"cispo: killing the API and the worker ({why})", flush=True)
            break
        for proc in running:
            seen.update(descendants(proc.pid))
        time.sleep(poll_s)
    for proc in running:
        if proc.poll() is None:
            seen.update(descendants(proc.pid))
            proc.kill()
        proc.wait()
    kill_if_alive(seen)


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (Linux /proc; {} elsewhere), with its start time, which tells a
    process from a later one that reuses its pid."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                kids = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                if kid not in found and (started := _start_time(kid)) is not None:
                    found[kid] = started
                    todo.append(kid)
    return found


def kill_if_alive(processes: dict[int, str]) -> None:
    """SIGKILL each process that is still the one recorded (same pid, same start time)."""
    for pid, started in processes.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile, or a sandbox's own uid (its init kills the sandbox)
                pass


def _start_time(pid: int) -> str | None:
    try:  # field 22 of /proc/PID/stat; the command name before it may hold spaces and parentheses
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
