"""User Python rewards, run in a separate, restricted child process.

``PythonRewardProcess`` keeps ONE long-lived child per job (worker/rewards/_child.py,
standard library only) and sends it batches over JSON lines. User code never
runs in the API, Celery or trainer process.

What this version guarantees:

- the child runs ``python -I -S`` (no site packages, no PYTHON* variables, no
  script directory on sys.path) in its own session and process group;
- its environment is an allow-list (PATH, LANG, PYTHONHASHSEED, HOME and
  TMPDIR); nothing else of the trainer's environment (database URLs, cloud
  keys) is passed on, and no other file descriptor is inherited;
- its working directory, HOME and TMPDIR are a fresh private (0700) temporary
  directory, deleted when that child is stopped;
- before user code runs it sets RLIMIT_AS (1 GiB), RLIMIT_FSIZE (16 MiB),
  RLIMIT_NOFILE (64), RLIMIT_CORE (0) and a per-batch RLIMIT_CPU budget, and
  moves the protocol to private descriptors, so user output cannot corrupt it;
- each sample has a cooperative timeout in the child (``timeout_s``), and each
  batch a hard wall-clock deadline in the parent (``timeout_s`` per sample plus
  slack, capped at ``max_batch_timeout_s``). On a missed deadline, a crash or
  a malformed answer the whole process group is SIGKILLed and reaped, every
  sample of the batch becomes an error, and the next batch starts a new child;
- ``close()`` (and garbage collection, as a fallback) SIGKILLs the process
  group and removes the directory. Processes the user code starts stay in the
  group, double-forked daemons included, and die with it.

Known gaps, for the hardening work: a process that calls setsid() (or
setpgid()) leaves the group and survives close(); the filesystem outside the
temporary directory and the network are reachable with the worker's uid and
permissions; there is no limit on the number of processes (RLIMIT_NPROC counts
per uid, so it needs its own uid or a pid namespace). A pid namespace (or a
cgroup with cgroup.kill), its own uid, a mount namespace and an empty network
namespace close these.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHILD_SCRIPT = Path(__file__).with_name("_child.py")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # plus RESPONSE_BYTES_PER_SAMPLE per sample
RESPONSE_BYTES_PER_SAMPLE = 1024
START_SLACK_S = 5.0  # interpreter start-up, on top of timeout_s for loading the source
BATCH_SLACK_S = 1.0


class RewardLoadError(ValueError):
    """The user source could not be loaded in the child (it raised, timed out, or lacks the entry point)."""


@dataclass
class BatchResult:
    scores: list[float | None]  # None where the sample failed
    errors: list[str | None]  # the failure, where scores has None


class _Failed(Exception):
    """The child missed its deadline, died or answered garbage; it is killed and the batch fails."""


class _Child:
    """One running child: the process, its pipes and its private directory."""

    def __init__(self, workdir: Path, proc: subprocess.Popen):
        self.workdir, self.proc = workdir, proc
        self.buffer = b""
        # Non-blocking, so a write to a full pipe or a read can never outlast the deadline.
        os.set_blocking(proc.stdin.fileno(), False)
        os.set_blocking(proc.stdout.fileno(), False)

    def stop(self) -> int | None:
        """SIGKILL the whole process group, reap the child, remove the directory; returns its exit code."""
        # Kill the group before reaping: until then the child's pid (the group id) cannot be reused.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel; the group was SIGKILLed all the same
            code = None
        _remove_tree(self.workdir)
        return code

    def exchange(self, message: dict[str, Any], deadline: float, max_bytes: int) -> dict[str, Any]:
        """Send one line, read one line back, both before the deadline (time.monotonic())."""
        out = memoryview(json.dumps(message).encode() + b"\n")
        stdin, stdout = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            if out:
                sel.register(stdin, selectors.EVENT_WRITE)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _Failed("timeout")
                for key, _ in sel.select(remaining):
                    if key.fd == stdin:
                        try:
                            written = os.write(stdin, out[:65536])
                        except BlockingIOError:
                            continue
                        except (BrokenPipeError, ConnectionResetError):
                            raise _Failed("died") from None
                        out = out[written:]
                        if not out:
                            sel.unregister(stdin)
                    else:
                        try:
                            chunk = os.read(stdout, 65536)
                        except BlockingIOError:
                            continue
                        if not chunk:
                            raise _Failed("died")
                        self.buffer += chunk
                        if len(self.buffer) > max_bytes:
                            raise _Failed(f"answer larger than {max_bytes} bytes")
                        line, newline, rest = self.buffer.partition(b"\n")
                        if newline:
                            if rest:
                                raise _Failed("unexpected output after its answer")
                            self.buffer = b""
                            try:
                                return json.loads(line)
                            except ValueError:
                                raise _Failed("malformed answer") from None


def _remove_tree(root: Path) -> None:
    """rmtree that also removes what user code made read-only, never touching anything outside root."""
    top = os.path.abspath(root)

    def inside(p: str) -> bool:
        return p == top or p.startswith(top + os.sep)

    def retry_writable(func, target, _exc):
        try:
            for p in (os.path.dirname(target), target):
                if inside(p) and os.path.isdir(p) and not os.path.islink(p):
                    os.chmod(p, stat.S_IRWXU)
            func(target)
        except OSError:
            pass

    shutil.rmtree(top, onerror=retry_writable)
    if os.path.lexists(top):
        shutil.rmtree(top, ignore_errors=True)


def _child_env(workdir: Path) -> dict[str, str]:
    return {
        "PATH": DEFAULT_PATH,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "HOME": str(workdir),
        "TMPDIR": str(workdir),
    }


class _State:
    """What close() and the GC fallback need, kept off the PythonRewardProcess so a finalizer may hold it."""

    def __init__(self):
        self.child: _Child | None = None
        self.closed = False

    def stop_child(self) -> int | None:
        child, self.child = self.child, None
        return child.stop() if child is not None else None

    def close(self) -> None:
        self.closed = True
        self.stop_child()


class PythonRewardProcess:
    """Scores batches with a user's ``reward(completion, **row)`` in a sandboxed child process.

    The child starts on the first ``score()`` and lives until ``close()``;
    after a timeout, crash or malformed answer it is killed and the next
    ``score()`` starts a new one. A source that fails to load raises
    ``RewardLoadError`` from ``score()``.
    """

    def __init__(
        self,
        source: str,
        entry_point: str = "reward",
        *,
        timeout_s: float = 10.0,
        max_batch_timeout_s: float = 600.0,
        memory_bytes: int = 1 << 30,
        file_size_bytes: int = 16 << 20,
        open_files: int = 64,
    ):
        if not (timeout_s > 0 and max_batch_timeout_s > 0):
            raise ValueError("timeouts must be positive")
        self.source, self.entry_point = source, entry_point
        self.timeout_s, self.max_batch_timeout_s = float(timeout_s), float(max_batch_timeout_s)
        self.limits = {"as": memory_bytes, "fsize": file_size_bytes, "nofile": open_files, "core": 0}
        self._state = _State()
        self._finalizer = weakref.finalize(self, _State.close, self._state)

    # -- public ---------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The running child's pid (also its process group id), or None."""
        return self._state.child.proc.pid if self._state.child else None

    @property
    def workdir(self) -> Path | None:
        """The running child's private directory (its cwd, HOME and TMPDIR), or None."""
        return self._state.child.workdir if self._state.child else None

    def batch_timeout(self, samples: int) -> float:
        return min(self.timeout_s * max(samples, 1) + BATCH_SLACK_S, self.max_batch_timeout_s)

    def score(self, completions: list[str], rows: list[dict]) -> BatchResult:
        if self._state.closed:
            raise RuntimeError("PythonRewardProcess is closed")
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        n = len(completions)
        if n == 0:
            return BatchResult([], [])
        child = self._ensure_started()
        budget = self.batch_timeout(n)
        message = {"completions": list(completions), "rows": list(rows), "cpu_s": budget}
        try:
            answer = child.exchange(message, time.monotonic() + budget, MAX_RESPONSE_BYTES + RESPONSE_BYTES_PER_SAMPLE * n)
            return _check_answer(answer, n)
        except _Failed as e:
            reason = str(e)
        code = self._state.stop_child()
        if reason == "timeout":
            error = f"timeout after {budget:g} s"
        elif reason == "died":
            error = _death(code)
        else:
            error = f"reward process sent an invalid answer ({reason}); restarted"
        return BatchResult([None] * n, [error] * n)

    def close(self) -> None:
        """Kill the child's process group and remove its directory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> PythonRewardProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------

    def _ensure_started(self) -> _Child:
        if self._state.child is not None:
            return self._state.child
        workdir = Path(tempfile.mkdtemp(prefix="cispo-reward-"))  # mode 0700
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(CHILD_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=workdir,
                env=_child_env(workdir),
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            _remove_tree(workdir)
            raise
        child = self._state.child = _Child(workdir, proc)
        init = {"source": self.source, "entry_point": self.entry_point, "timeout_s": self.timeout_s,
                "limits": self.limits}
        try:
            answer = child.exchange(init, time.monotonic() + self.timeout_s + START_SLACK_S, MAX_RESPONSE_BYTES)
        except _Failed as e:
            code = self._state.stop_child()
            detail = _death(code) if str(e) == "died" else str(e)
            raise RewardLoadError(f"reward source failed to load: {detail}") from None
        if answer.get("ok") is not True:
            self._state.stop_child()
            raise RewardLoadError(f"reward source failed to load: {answer.get('error', answer)}")
        return child


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        return f"reward process died (signal {-code})"
    return f"reward process died (exit code {code})"


def _check_answer(answer: Any, n: int) -> BatchResult:
    if not isinstance(answer, dict):
        raise _Failed("not an object")
    scores, errors = answer.get("scores"), answer.get("errors")
    if not (isinstance(scores, list) and isinstance(errors, list) and len(scores) == len(errors) == n):
        raise _Failed(f"expected {n} scores and errors")
    for s, e in zip(scores, errors):
        ok_score = s is None or (type(s) in (int, float) and math.isfinite(s))
        ok_error = (e is None) != (s is None) and (e is None or isinstance(e, str))
        if not (ok_score and ok_error):
            raise _Failed("bad score entry")
    return BatchResult([None if s is None else float(s) for s in scores], [None if e is None else (e or "error")[:500] for e in errors])
