"""A sandboxed child process spoken to in JSON lines, with a hard deadline on every exchange.

Shared by the user Python environments (worker/envs/python_env.py) and the
user Python rewards (worker/rewards/sandbox.py).

The containment is service/sandbox/spawn.py's (own pid, network, mount and IPC
namespaces, a uid of its own, a seccomp filter, a cgroup bounding its memory
and processes, a new root where only a size-capped private tmpfs is
writable, rlimits, an allow-listed environment); where
the host cannot provide it, spawn() refuses and so does this module. On top
of that: reads and writes are non-blocking, so neither a full pipe nor a
silent child can outlast the deadline, answers are capped in size, and
``stop()`` kills everything in the sandbox (its tmpfs goes with it) and removes
the host's placeholder directory.

INTERRUPT cuts every exchange short (the job was cancelled): the child is
stopped and Interrupted raised within POLL_S, instead of the batch running
on to its deadline (up to 10 minutes).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any

from service.sandbox.spawn import Limits, exit_status, kill, new_workdir, python_argv, spawn


CHILD_BOOTSTRAP = Path(__file__).with_name("child_bootstrap.py")  # runs before every child's own source


class ChildFailed(Exception):
    """The child missed its deadline, died or answered garbage; the caller must stop() it."""


# Set by the job runner while its cancelled job winds down (one job at a time per process).
INTERRUPT = threading.Event()
POLL_S = 0.25  # how often a waiting exchange looks at INTERRUPT


class Interrupted(Exception):
    """INTERRUPT was set while an exchange waited on the child; the child is stopped already."""


class JsonLinesChild:
    """One running child: its process, pipes and private directory."""

    def __init__(self, script: Path, *, limits: Limits, prefix: str = "cispo-child-"):
        self.workdir = new_workdir(prefix)
        try:
            self.proc = spawn(python_argv(CHILD_BOOTSTRAP, script), workdir=self.workdir, limits=limits)
        except BaseException:
            _remove(self.workdir)
            raise
        self.buffer = b""
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)

    def stop(self) -> int | None:
        """Kill everything in the sandbox, reap it, remove the directory; returns the child's exit status.
        Idempotent: an interrupted exchange stops its child, and its owner stops it again."""
        try:
            kill(self.proc)
        finally:
            _remove(self.workdir)
        return exit_status(self.proc.returncode)

    def exchange(self, message: dict[str, Any], deadline: float, max_bytes: int) -> Any:
        """Send one line and read one line back, both before ``deadline`` (time.monotonic())."""
        out = memoryview(json.dumps(message).encode() + b"\n")
        stdin, stdout = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            sel.register(stdin, selectors.EVENT_WRITE)
            while True:
                if INTERRUPT.is_set():
                    self.stop()
                    raise Interrupted("the job was cancelled while user code ran")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ChildFailed("timeout")
                for key, _ in sel.select(min(remaining, POLL_S)):
                    if key.fd == stdin:
                        try:
                            out = out[os.write(stdin, out[:65536]):]
                        except BlockingIOError:
                            continue
                        except (BrokenPipeError, ConnectionResetError):
                            raise ChildFailed("died") from None
                        if not out:
                            sel.unregister(stdin)
                        continue
                    try:
                        chunk = os.read(stdout, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        raise ChildFailed("died")
                    self.buffer += chunk
                    if len(self.buffer) > max_bytes:
                        raise ChildFailed(f"answer larger than {max_bytes} bytes")
                    line, newline, rest = self.buffer.partition(b"\n")
                    if newline:
                        if rest:
                            raise ChildFailed("unexpected output after its answer")
                        self.buffer = b""
                        try:
                            return json.loads(line)
                        except ValueError:
                            raise ChildFailed("malformed answer") from None


def _remove(root: Path) -> None:
    """Remove the child's directory, including what user code made read-only; never follows links out."""
    top = os.path.abspath(root)

    def retry_writable(func, target, _exc):
        try:
            for p in (os.path.dirname(target), target):
                if (p == top or p.startswith(top + os.sep)) and os.path.isdir(p) and not os.path.islink(p):
                    os.chmod(p, stat.S_IRWXU)
            func(target)
        except OSError:
            pass

    shutil.rmtree(top, onerror=retry_writable)
    if os.path.lexists(top):
        shutil.rmtree(top, ignore_errors=True)


class ChildHolder:
    """The one child a user-code process keeps, and whether it was closed. Kept off the process object, so
    the weakref.finalize fallback that closes it may hold this without keeping the object alive."""

    def __init__(self):
        self.child: JsonLinesChild | None = None
        self.closed = False

    def stop(self) -> int | None:
        child, self.child = self.child, None
        return child.stop() if child is not None else None

    def close(self) -> None:
        self.closed = True
        self.stop()


def describe_death(code: int | None, who: str) -> str:
    """How a child that died is reported, e.g. "reward process died (signal 11)"; ``code`` is from stop()."""
    if code is not None and code < 0:
        return f"{who} died (signal {-code})"
    return f"{who} died (exit code {code})"
