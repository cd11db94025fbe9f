"""A user's Python environment class, hosted in one sandboxed child process per job.

The sandbox is service/sandbox/spawn.py's (namespaces, an unprivileged uid, rlimits:
address space ``memory_mb``, 16 MiB files, 64 open files, 64 processes);
where the host cannot provide it, constructing the environment raises
SandboxUnavailable and the job fails: user code never runs unconfined.

The child (worker/envs/_env_child.py) holds one instance of the class per
episode id and answers batched reset / step requests, so a turn of a whole
rollout batch costs one round trip. User code never runs in the trainer.

Failures, from small to large:
- one episode's call raises, times out (``timeout_s``, cooperative, in the
  child) or returns something outside the protocol: that episode fails;
- the child misses the batch's hard deadline (``timeout_s`` per episode plus
  slack, capped), dies, or answers garbage: it is killed, every episode of
  the batch fails and so do the other episodes it was hosting; the next
  reset starts a new child;
- the source fails to load (raises, lacks the class): ``EnvironmentLoadError``
  from reset(), which fails the job, since no episode could ever run.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path

from service.schemas.environments import PythonEnvironment
from service.sandbox.channel import ChildFailed, ChildHolder, JsonLinesChild, describe_death
from service.sandbox.spawn import Limits, SandboxProcess, require_sandbox
from worker.envs.protocol import Outcome, checked, failed, reset_outcome, step_outcome

CHILD_SCRIPT = Path(__file__).with_name("_env_child.py")
START_SLACK_S = 5.0
BATCH_SLACK_S = 1.0
MAX_BATCH_TIMEOUT_S = 600.0
MAX_ANSWER_BYTES = 4 << 20
ANSWER_BYTES_PER_EPISODE = 1 << 20


class EnvironmentLoadError(ValueError):
    """The user source could not be loaded in the child."""


class PythonEnvironmentProcess:
    def __init__(self, spec: PythonEnvironment, *, max_batch_timeout_s: float = MAX_BATCH_TIMEOUT_S):
        self.spec = spec
        self.timeout_s = spec.timeout_s
        self.max_batch_timeout_s = max_batch_timeout_s
        require_sandbox()
        # No hard CPU limit: the child budgets CPU per batch (soft), the parent's deadline is the hard stop.
        self.limits = Limits(cpu_s=None, address_space_bytes=spec.memory_mb << 20, memory_bytes=spec.memory_mb << 20)
        self._holder = ChildHolder()
        self._finalizer = weakref.finalize(self, ChildHolder.close, self._holder)

    @property
    def pid(self) -> int | None:
        return self._holder.child.proc.pid if self._holder.child else None

    @property
    def sandbox(self) -> SandboxProcess | None:
        """The running sandbox (its ``members()`` are the processes in it), or None."""
        return self._holder.child.proc if self._holder.child else None

    def _started(self) -> JsonLinesChild:
        if self._holder.closed:
            raise RuntimeError("environment is closed")
        if self._holder.child is not None:
            return self._holder.child
        child = self._holder.child = JsonLinesChild(CHILD_SCRIPT, limits=self.limits, prefix="cispo-env-")
        init = {"source": self.spec.source, "class_name": self.spec.class_name, "timeout_s": self.timeout_s}
        try:
            answer = child.exchange(init, time.monotonic() + self.timeout_s + START_SLACK_S, MAX_ANSWER_BYTES)
        except ChildFailed as e:
            code = self._holder.stop()
            raise EnvironmentLoadError(
                f"environment source failed to load: {describe_death(code, 'environment process') if str(e) == 'died' else e}") from None
        if not (isinstance(answer, dict) and answer.get("ok") is True):
            self._holder.stop()
            detail = answer.get("error", answer) if isinstance(answer, dict) else answer
            raise EnvironmentLoadError(f"environment source failed to load: {detail}")
        return child

    def _batch(self, op: str, items: list[list], check) -> list[Outcome]:
        if not items:
            return []
        if op == "step" and self._holder.child is None:
            return [failed("the environment process was restarted; this episode's state is gone")] * len(items)
        child = self._started()
        budget = min(self.timeout_s * len(items) + BATCH_SLACK_S, self.max_batch_timeout_s)
        request = {"op": op, "episodes": items, "cpu_s": budget}
        limit = MAX_ANSWER_BYTES + ANSWER_BYTES_PER_EPISODE * len(items)
        try:
            answer = child.exchange(request, time.monotonic() + budget, limit)
            results = answer.get("results") if isinstance(answer, dict) else None
            if not (isinstance(results, list) and len(results) == len(items)):
                raise ChildFailed(f"expected {len(items)} results")
        except ChildFailed as e:
            reason = str(e)
            code = self._holder.stop()
            if reason == "timeout":
                message = f"timeout after {budget:g} s (the environment process was restarted)"
            elif reason == "died":
                message = describe_death(code, "environment process")
            else:
                message = f"environment process sent an invalid answer ({reason}); restarted"
            return [failed(message)] * len(items)
        return [failed(r["error"] if isinstance(r["error"], str) else "error")
                if isinstance(r, dict) and "error" in r else checked(check, r) for r in results]

    def reset(self, episodes: list[tuple[str, int, dict]]) -> list[Outcome]:
        return self._batch("reset", [[eid, seed, row] for eid, seed, row in episodes], reset_outcome)

    def step(self, actions: list[tuple[str, str]]) -> list[Outcome]:
        return self._batch("step", [[eid, action] for eid, action in actions], step_outcome)

    def release(self, episode_ids: list[str]) -> None:
        child = self._holder.child
        if child is None or not episode_ids:
            return
        try:
            child.exchange({"op": "release", "ids": list(episode_ids)},
                           time.monotonic() + self.timeout_s + BATCH_SLACK_S, MAX_ANSWER_BYTES)
        except ChildFailed:
            self._holder.stop()

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> PythonEnvironmentProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
