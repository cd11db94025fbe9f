"""The ``http`` reward: batches POSTed to a user's scoring endpoint, through the egress policy.

Every request goes through service/egress.py: the URL is resolved and vetted
each time (no loopback, private or link-local address unless an operator
allow-listed it), the connection is pinned to the vetted address, redirects
are not followed and the answer is size-capped. Transient failures
(timeouts, connection errors, 429, 5xx) are retried with exponential
backoff; anything else fails the batch at once. The secret's value is sent
as a header and scrubbed from every error message, so it cannot leak into
events or job errors even if an endpoint echoes it back.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import httpx

from service.egress import EgressPolicy, EgressRefused, check_url, post_json
from service.schemas.reward_remote import HttpReward
from worker.rewards.errors import ScoringError
from worker.rewards.outcome import Outcome

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
backoff_sleep: Callable[[float], None] = time.sleep  # tests replace it to check the delays without waiting


def _transient(exc: Exception) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code == 429 or exc.response.status_code >= 500
    return isinstance(exc, (httpx.TimeoutException, httpx.TransportError))


def _describe_http(exc: Exception) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, httpx.TransportError):
        return f"connection failed ({type(exc).__name__})"
    return str(exc)


def post_with_retries(url: str, payload: Any, policy: EgressPolicy, *, headers: dict[str, str], retries: int,
                      prefix: str, secret: str | None = None) -> Any:
    """POST JSON, retrying transient failures; raises ScoringError('<prefix> ...') with secrets scrubbed."""
    attempt = 0
    while True:
        try:
            return post_json(check_url(url, policy), payload, policy, headers=headers)
        except EgressRefused as e:
            raise ScoringError(_scrub(f"{prefix} refused by the egress policy: {e}", secret)) from None
        except Exception as e:  # noqa: BLE001 - every failure becomes the batch's message
            if not _transient(e) or attempt >= retries:
                tries = f" after {attempt + 1} attempts" if attempt else ""
                raise ScoringError(_scrub(f"{prefix} {_describe_http(e)}{tries}", secret)) from None
        backoff_sleep(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** attempt))
        attempt += 1


def _scrub(message: str, secret: str | None) -> str:
    return message.replace(secret, "***") if secret else message


def _score_value(value: Any) -> tuple[float | None, str | None]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"http: the endpoint returned {type(value).__name__}, not a number"
    if not math.isfinite(value):
        return None, f"http: the endpoint returned {value}, not a finite number"
    return float(value), None


class HttpBatchScorer:
    """Scores with an ``http`` reward spec; one request per ``batch_size`` samples."""

    def __init__(self, spec: HttpReward, policy: EgressPolicy, secret: str | None = None):
        self.spec, self.secret = spec, secret
        self.policy = dataclasses.replace(policy, read_timeout_s=spec.timeout_s)
        self.headers = {spec.header: secret} if secret is not None else {}

    def score(self, completions: list[str], rows: list[dict]) -> Outcome:
        out = Outcome.empty(len(completions))
        size = self.spec.batch_size
        for start in range(0, len(completions), size):
            chunk = range(start, min(start + size, len(completions)))
            try:
                values = self._request([completions[i] for i in chunk], [rows[i] for i in chunk])
            except ScoringError as e:
                for i in chunk:
                    out.errors[i] = str(e)
                continue
            for i, value in zip(chunk, values):
                out.scores[i], out.errors[i] = _score_value(value)
        return out

    def _request(self, completions: list[str], rows: list[dict]) -> list[Any]:
        payload = {"samples": [{"completion": c, "row": r} for c, r in zip(completions, rows)]}
        answer = post_with_retries(self.spec.url, payload, self.policy, headers=self.headers,
                                   retries=self.spec.retries, prefix="http:", secret=self.secret)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise ScoringError('http: the response is not {"scores": [...]}')
        if len(scores) != len(completions):
            raise ScoringError(f"http: the response has {len(scores)} scores for {len(completions)} samples")
        return scores

    def close(self) -> None:
        pass
