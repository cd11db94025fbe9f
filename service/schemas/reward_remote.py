"""Reward specs that call out over the network: a user's scoring endpoint, or a judge model.

Both go through service/egress.py (public addresses only unless an operator
allow-lists them, no redirects, capped responses). A spec holds only the NAME
of a project secret (``auth_secret``); the worker reads the value from the
database when the job starts, so the value is never in the job spec, its
events, its errors, or any API response.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from service.schemas.reward_base import HeaderName, HttpUrl, RewardBase, SecretName, Template

# A judge's score is a number the tenant reads back (reward tests, graders/run, metrics). Unbounded, a range such
# as [0, 1e300] would pass the judge's number on as given, 15 digits of whatever the judge was asked to encode;
# so a range's ends are bounded and a score keeps SCORE_DIGITS significant digits of the range's width
# (worker/rewards/judge.py).
MAX_SCORE_RANGE = 10_000.0
SCORE_DIGITS = 4


def check_score_range(score_range: tuple[float, float]) -> tuple[float, float]:
    """Raises ValueError unless `score_range` is [low, high] with low < high, both within +-MAX_SCORE_RANGE."""
    low, high = score_range
    if not (-MAX_SCORE_RANGE <= low <= MAX_SCORE_RANGE and -MAX_SCORE_RANGE <= high <= MAX_SCORE_RANGE):
        raise ValueError(f"range {list(score_range)}: each end must lie from {-MAX_SCORE_RANGE:g} to "
                         f"{MAX_SCORE_RANGE:g} (a judge's score keeps {SCORE_DIGITS} significant digits of the "
                         "range)")
    if not low < high:
        raise ValueError(f"range {list(score_range)} must be [low, high] with low < high")
    return score_range


class HttpReward(RewardBase):
    """Scores batches on a remote endpoint.

    Request: POST ``url`` with ``{"samples": [{"completion": str, "row": {...}}, ...]}`` (at most
    ``batch_size`` samples) and, with ``auth_secret``, the header ``header: <secret value>``
    (store e.g. "Bearer abc" as the value for bearer auth).
    Response: ``{"scores": [number, ...]}``, one per sample, in order. A null or non-numeric
    entry fails that sample; a response of another shape or length, an HTTP error or a
    timeout fails the whole batch. Timeouts, connection errors, 429 and 5xx are retried
    ``retries`` times with exponential backoff (0.5 s, 1 s, 2 s, ... capped at 8 s).
    """

    type: Literal["http"] = "http"
    url: HttpUrl
    auth_secret: SecretName | None = None
    header: HeaderName = "Authorization"
    timeout_s: float = Field(10.0, gt=0, le=120, description="Read timeout per request.")
    retries: int = Field(2, ge=0, le=5)
    batch_size: int = Field(32, ge=1, le=1024)


class JudgeMessage(RewardBase):
    role: Literal["system", "user", "assistant", "developer"]
    content: Template


class JudgeSampling(RewardBase):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    max_completions_tokens: int | None = Field(None, ge=1, le=65536)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class ScoreModelReward(RewardBase):
    """A judge model's score (OpenAI's score_model grader), on an OpenAI-compatible chat endpoint.

    The messages are rendered per sample and sent to ``<base_url>/chat/completions`` with
    ``model``. The reply is read as JSON ``{"result": number}`` (or ``{"score": number}``),
    else the last number in its text; it is clipped to ``range`` (whose ends lie within +-MAX_SCORE_RANGE) and
    rounded to SCORE_DIGITS significant digits of the range's width. No number is a sample error.
    The endpoint is the service's judge (settings judge_base_url / judge_api_key) unless
    ``base_url`` (and optionally ``auth_secret``, sent as "Authorization: Bearer <value>") is given.
    """

    type: Literal["score_model"] = "score_model"
    model: str = Field(min_length=1, max_length=200)
    input: list[JudgeMessage] = Field(min_length=1, max_length=64)
    range: tuple[float, float] = (0.0, 1.0)
    sampling_params: JudgeSampling = JudgeSampling()
    base_url: HttpUrl | None = None
    auth_secret: SecretName | None = None
    timeout_s: float = Field(60.0, gt=0, le=600)
    retries: int = Field(2, ge=0, le=5)
    max_concurrency: int = Field(8, ge=1, le=64, description="Samples judged at once.")

    @field_validator("range")
    @classmethod
    def _range(cls, value: tuple[float, float]) -> tuple[float, float]:
        return check_score_range(value)

    @model_validator(mode="after")
    def _secret_needs_url(self) -> ScoreModelReward:
        if self.auth_secret and not self.base_url:
            raise ValueError("auth_secret needs base_url (the service's judge uses its own key)")
        return self
