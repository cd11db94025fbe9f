"""A remote environment over HTTP: POST {url}/reset and {url}/step, one request per episode.

Every request goes through service/egress.py: the URL is resolved once per
job and must resolve to public addresses (or ones the operator allow-listed),
the connection is pinned to the checked address, redirects are not followed
and answers are read up to a size cap. Requests of one turn run concurrently.

Retries: ``reset`` is retried (``max_retries`` times, with backoff) on a
transport failure or a 5xx answer, since resetting an episode id again is
idempotent by protocol. ``step`` is not idempotent, so it is retried only
when the request cannot have reached the server (the connection failed).
Anything else - a timeout, a 4xx, an answer that is not JSON or not the
protocol - fails that episode, never the job.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from service.egress import EgressPolicy, EgressRefused, Target, check_url, post_json
from service.schemas.environments import HttpEnvironment
from worker.envs.protocol import Outcome, checked, failed, reset_outcome, step_outcome

MAX_PARALLEL_REQUESTS = 16
BACKOFF_S = 0.2


def _describe(e: Exception) -> str:
    if isinstance(e, httpx.TimeoutException):
        return f"timeout ({type(e).__name__})"
    if isinstance(e, httpx.HTTPStatusError):
        return str(e)
    return f"{type(e).__name__}: {e}"


class HttpEnvironmentClient:
    def __init__(self, spec: HttpEnvironment, *, policy: EgressPolicy, secret: str | None = None):
        if spec.auth_secret and secret is None:
            raise ValueError(f"environment.auth_secret: secret {spec.auth_secret!r} was not provided")
        self.spec = spec
        self.policy = dataclasses.replace(
            policy, read_timeout_s=spec.timeout_s, connect_timeout_s=min(policy.connect_timeout_s, spec.timeout_s))
        self.headers = {spec.header: secret} if secret else {}
        # Resolved and vetted once per job; a refusal fails the job with the reason.
        self.targets: dict[str, Target] = {op: check_url(f"{spec.url}/{op}", self.policy) for op in ("reset", "step")}
        self.client = httpx.Client(follow_redirects=False)

    def _post(self, op: str, payload: dict, *, retry_any: bool):
        """The parsed JSON answer; retries as the module docstring says, else raises."""
        for attempt in range(self.spec.max_retries + 1):
            try:
                return post_json(self.targets[op], payload, self.policy, headers=self.headers, client=self.client)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                error: Exception = e
            except httpx.HTTPStatusError as e:
                if not (retry_any and e.response.status_code >= 500):
                    raise
                error = e
            except httpx.TransportError as e:
                if not retry_any:
                    raise
                error = e
            if attempt == self.spec.max_retries:
                raise error
            time.sleep(BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    def _one(self, op: str, payload: dict, check) -> Outcome:
        try:
            answer = self._post(op, payload, retry_any=(op == "reset"))
        except (httpx.HTTPError, EgressRefused, ValueError) as e:
            return failed(f"{op}: {_describe(e)}")
        return checked(check, answer)

    def _many(self, op: str, payloads: list[dict], check) -> list[Outcome]:
        if len(payloads) <= 1:
            return [self._one(op, p, check) for p in payloads]
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_REQUESTS, len(payloads))) as pool:
            return list(pool.map(lambda p: self._one(op, p, check), payloads))

    def reset(self, episodes: list[tuple[str, int, dict]]) -> list[Outcome]:
        payloads = [{"episode_id": eid, "seed": seed, "row": row} for eid, seed, row in episodes]
        return self._many("reset", payloads, reset_outcome)

    def step(self, actions: list[tuple[str, str]]) -> list[Outcome]:
        return self._many("step", [{"episode_id": eid, "action": a} for eid, a in actions], step_outcome)

    def release(self, episode_ids: list[str]) -> None:
        pass  # the protocol has no release; a server forgets an episode when it ends

    def close(self) -> None:
        self.client.close()
