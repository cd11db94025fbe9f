"""User Python rewards, run contained in a sandbox (service/sandbox/spawn.py).

``PythonRewardProcess`` keeps ONE long-lived child per job (worker/rewards/_child.py,
standard library only) and sends it batches over JSON lines. User code never
runs in the API, Celery or trainer process. ``PythonRewardPool`` splits each
batch over several such children.

The containment is service/sandbox/spawn.py's: own pid, network, mount and IPC
namespaces, an unprivileged uid, a new root with only the system, the
interpreter and a private size-capped tmpfs working directory (also HOME and
TMPDIR, the only writable place, gone when that child stops), a uid of its
own, a seccomp filter, a cgroup bounding the memory (1 GiB) and processes (64)
of the whole sandbox, an allow-listed environment, rlimits (address space
1 GiB, file size 16 MiB, 64 open files, no core). Where the host cannot provide that, or
CISPO_SANDBOX=off, constructing a PythonRewardProcess raises SandboxUnavailable:
user code is refused, never run unconfined.

On top of that, this module:

- moves the protocol to private descriptors in the child before user code
  runs (user output goes to /dev/null and cannot corrupt it), and caps the
  answer's size;
- gives each sample a cooperative timeout in the child (``timeout_s``) and
  each batch a hard wall-clock deadline in the parent (``timeout_s`` per
  sample plus slack, capped at ``max_batch_timeout_s``), with a matching soft
  CPU budget in the child. On a missed deadline, a crash or a malformed answer
  the sandbox is killed (every process in it, daemons included), every sample
  of the batch becomes an error, and the next batch starts a new child;
- ``close()`` (and garbage collection, as a fallback) kills the sandbox and
  removes the directory.
"""

from __future__ import annotations

import math
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.sandbox.spawn import Limits, SandboxProcess, require_sandbox
from service.sandbox.channel import ChildFailed, ChildHolder, JsonLinesChild, describe_death

CHILD_SCRIPT = Path(__file__).with_name("_child.py")
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


class PythonRewardProcess:
    """Scores batches with a user's ``reward(completion, **row)`` in a sandboxed child process.

    Constructing it raises SandboxUnavailable where user code cannot be
    contained (fail closed). The child starts on the first ``score()`` and
    lives until ``close()``; after a timeout, crash or malformed answer it is
    killed and the next ``score()`` starts a new one. A source that fails to
    load raises ``RewardLoadError`` from ``score()``.
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
        max_processes: int = 64,
    ):
        if not (timeout_s > 0 and max_batch_timeout_s > 0):
            raise ValueError("timeouts must be positive")
        require_sandbox()
        self.source, self.entry_point = source, entry_point
        self.timeout_s, self.max_batch_timeout_s = float(timeout_s), float(max_batch_timeout_s)
        # No hard CPU limit: the child budgets CPU per batch (soft), the parent's deadline is the hard stop.
        self.limits = Limits(cpu_s=None, address_space_bytes=memory_bytes, memory_bytes=memory_bytes,
                             file_size_bytes=file_size_bytes, open_files=open_files, max_processes=max_processes)
        self._state = ChildHolder()
        self._finalizer = weakref.finalize(self, ChildHolder.close, self._state)

    # -- public ---------------------------------------------------------------

    @property
    def sandbox(self) -> SandboxProcess | None:
        """The running sandbox (its ``members()`` are the processes in it), or None."""
        return self._state.child.proc if self._state.child else None

    @property
    def pid(self) -> int | None:
        """The running sandbox's pid on this host (its holder process), or None."""
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
        except ChildFailed as e:
            reason = str(e)
        code = self._state.stop()
        if reason == "timeout":
            error = f"timeout after {budget:g} s"
        elif reason == "died":
            error = describe_death(code, "reward process")
        else:
            error = f"reward process sent an invalid answer ({reason}); restarted"
        return BatchResult([None] * n, [error] * n)

    def close(self) -> None:
        """Kill the sandbox (every process in it) and remove its directory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> PythonRewardProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------

    def _ensure_started(self) -> JsonLinesChild:
        if self._state.child is not None:
            return self._state.child
        child = self._state.child = JsonLinesChild(CHILD_SCRIPT, limits=self.limits, prefix="cispo-reward-")
        init = {"source": self.source, "entry_point": self.entry_point, "timeout_s": self.timeout_s}
        try:
            answer = child.exchange(init, time.monotonic() + self.timeout_s + START_SLACK_S, MAX_RESPONSE_BYTES)
        except ChildFailed as e:
            code = self._state.stop()
            detail = describe_death(code, "reward process") if str(e) == "died" else str(e)
            raise RewardLoadError(f"reward source failed to load: {detail}") from None
        if answer.get("ok") is not True:
            self._state.stop()
            raise RewardLoadError(f"reward source failed to load: {answer.get('error', answer)}")
        return child


class PythonRewardPool:
    """Several PythonRewardProcess children; each batch is split into contiguous chunks scored in parallel.

    Same API as PythonRewardProcess. Each child is its own sandbox; a failure
    fails only its chunk's samples, and that child restarts on the next batch.
    """

    def __init__(self, source: str, entry_point: str = "reward", *, processes: int = 2, **options):
        if processes < 1:
            raise ValueError("processes must be at least 1")
        self.children = [PythonRewardProcess(source, entry_point, **options) for _ in range(processes)]
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="reward-pool")

    def score(self, completions: list[str], rows: list[dict]) -> BatchResult:
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        size = -(-len(completions) // len(self.children)) or 1
        chunks = [(completions[i:i + size], rows[i:i + size]) for i in range(0, len(completions), size)]
        futures = [self._threads.submit(child.score, c, r) for child, (c, r) in zip(self.children, chunks)]
        result, error = BatchResult([], []), None
        for future in futures:  # await every one, so no child is left mid-exchange when one raises
            try:
                part = future.result()
            except BaseException as e:  # RewardLoadError, SandboxError: the same for every child
                error = error or e
                continue
            result.scores += part.scores
            result.errors += part.errors
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        for child in self.children:
            child.close()
        self._threads.shutdown(wait=True)

    def __enter__(self) -> PythonRewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_answer(answer: Any, n: int) -> BatchResult:
    if not isinstance(answer, dict):
        raise ChildFailed("not an object")
    scores, errors = answer.get("scores"), answer.get("errors")
    if not (isinstance(scores, list) and isinstance(errors, list) and len(scores) == len(errors) == n):
        raise ChildFailed(f"expected {n} scores and errors")
    for s, e in zip(scores, errors):
        ok_score = s is None or (type(s) in (int, float) and math.isfinite(s))
        ok_error = (e is None) != (s is None) and (e is None or isinstance(e, str))
        if not (ok_score and ok_error):
            raise ChildFailed("bad score entry")
    return BatchResult([None if s is None else float(s) for s in scores], [None if e is None else (e or "error")[:500] for e in errors])
