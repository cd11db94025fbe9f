"""The environment protocol as the trainer sees it: batched, per episode id, never raising per episode.

Both kinds (a sandboxed Python class, a remote HTTP server) answer through
this one interface, so the rollout engine has a single path. Calls are
batched across the episodes that are still running, because a round trip to
a child process or a server costs far more than one episode's work. A
failure that belongs to one episode (an exception in user code, a malformed
answer, a timeout) comes back as that episode's ``Outcome.error`` and never
raises: the episode ends with the job's failure score and the job goes on.

Answers from user code or a remote server are untrusted, so every one is
checked here, in one place, before the trainer uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

Observation = str | list[dict]
MAX_OBSERVATION_CHARS = 1 << 20
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Outcome:
    """One episode's answer to reset (observation only) or step; ``error`` set means the episode failed."""

    observation: Observation | None = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated or self.error is not None


class Environment(Protocol):
    def reset(self, episodes: list[tuple[str, int, dict]]) -> list[Outcome]:
        """Start episodes given as (episode_id, seed, row); one Outcome (with an observation) each."""
        ...

    def step(self, actions: list[tuple[str, str]]) -> list[Outcome]:
        """Apply (episode_id, action text) to running episodes; one Outcome each."""
        ...

    def release(self, episode_ids: list[str]) -> None:
        """Forget finished episodes (their state may be freed)."""
        ...

    def close(self) -> None:
        ...


class ProtocolError(ValueError):
    """An answer outside the protocol; the message says what was wrong."""


def failed(message: str) -> Outcome:
    return Outcome(error=message[:MAX_ERROR_CHARS] or "error")


def check_observation(value: Any, *, optional: bool = False) -> Observation | None:
    """A string or a list of {"role": str, "content": str} messages (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        if len(value) > MAX_OBSERVATION_CHARS:
            raise ProtocolError(f"observation is longer than {MAX_OBSERVATION_CHARS} characters")
        return value
    if isinstance(value, list) and value:
        size = 0
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]
                    and isinstance(m.get("content"), str)):
                raise ProtocolError(f"observation[{i}] must be a message {{'role': str, 'content': str}}")
            size += len(m["content"])
        if size > MAX_OBSERVATION_CHARS:
            raise ProtocolError(f"observation is longer than {MAX_OBSERVATION_CHARS} characters")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ProtocolError(f"observation must be a string or a non-empty list of chat messages, "
                        f"got {type(value).__name__}")


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ProtocolError(f"{name} must be a bool, got {type(value).__name__}")


def check_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"reward must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ProtocolError(f"reward must be finite, got {value}")
    return value


def reset_outcome(answer: Any) -> Outcome:
    """Check a reset answer {"observation": ...}; a missing or null observation means 'use the row's prompt'."""
    if not isinstance(answer, dict):
        raise ProtocolError(f"reset must answer an object, got {type(answer).__name__}")
    return Outcome(observation=check_observation(answer.get("observation"), optional=True))


def step_outcome(answer: Any) -> Outcome:
    """Check a step answer {"observation", "reward", "terminated", "truncated"[, "info"]}.

    The observation may be null once the episode is over; otherwise it is the next user turn.
    """
    if not isinstance(answer, dict):
        raise ProtocolError(f"step must answer an object, got {type(answer).__name__}")
    missing = [k for k in ("reward", "terminated", "truncated") if k not in answer]
    if missing:
        raise ProtocolError(f"step answer lacks {', '.join(missing)}")
    terminated = _flag(answer["terminated"], "terminated")
    truncated = _flag(answer["truncated"], "truncated")
    reward = check_reward(answer["reward"])
    observation = check_observation(answer.get("observation"), optional=terminated or truncated)
    return Outcome(observation=observation, reward=reward, terminated=terminated, truncated=truncated)


def checked(check, answer: Any) -> Outcome:
    """``check(answer)``, with a protocol violation turned into a failed Outcome."""
    try:
        return check(answer)
    except ProtocolError as e:
        return failed(f"bad answer: {e}")
