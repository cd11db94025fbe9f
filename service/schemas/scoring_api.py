"""Public shapes for secrets, reward tests and OpenAI's graders run/validate endpoints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from service.schemas.api import Request, ServiceReward, Text
from service.schemas.reward_base import SecretName

MAX_TEST_SAMPLES = 32
MAX_SECRET_CHARS = 8192


# -- secrets -------------------------------------------------------------------


# A hostname or IP address, optionally "*." + a domain (any subdomain of it); no scheme, port or path.
HostPattern = Annotated[str, Field(pattern=r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?$|^[0-9a-fA-F:]{2,39}$",
                                   description="e.g. 'grader.example.com', '*.example.com' or '10.0.0.7'")]


class SecretCreate(Request):
    name: SecretName
    value: Text = Field(min_length=1, max_length=MAX_SECRET_CHARS, description="Stored encrypted; never returned.")
    hosts: list[HostPattern] = Field(min_length=1, max_length=20, description="The only hosts this secret may be "
                                     "sent to (a remote reward's, environment's or judge's URL host).")


class SecretObject(BaseModel):
    """A secret as the API shows it: never its value."""

    id: str
    object: Literal["secret"] = "secret"
    name: str
    hosts: list[str]
    created_at: int


# -- reward tests ----------------------------------------------------------------


class RewardTestSample(Request):
    completion: str = Field(max_length=200_000)
    row: dict[str, Any] = Field(default_factory=dict)


class RewardTestRequest(Request):
    """Samples to score: ``completions`` (with ``rows``, same length; omitted rows are empty), or ``samples``."""

    completions: list[str] | None = Field(None, min_length=1, max_length=MAX_TEST_SAMPLES)
    rows: list[dict[str, Any]] | None = Field(None, min_length=1, max_length=MAX_TEST_SAMPLES)
    # validate_default: the check below runs when samples is left out too, so its error names a field.
    samples: list[RewardTestSample] | None = Field(None, min_length=1, max_length=MAX_TEST_SAMPLES,
                                                   validate_default=True)

    @field_validator("samples")
    @classmethod
    def _one_form(cls, samples: list | None, info: ValidationInfo) -> list | None:
        if "completions" not in info.data:  # completions were refused: that error is enough
            return samples
        if samples is not None and info.data["completions"] is not None:
            raise ValueError("give completions (and rows) or samples, not both")
        if samples is None and info.data["completions"] is None:
            raise ValueError("give completions (and rows) or samples")
        return samples

    @model_validator(mode="after")
    def _rows_fit(self) -> RewardTestRequest:
        if self.samples is not None and self.rows is not None:
            raise ValueError("rows go with completions; samples carry their own row")
        if self.completions is not None and self.rows is not None and len(self.rows) != len(self.completions):
            raise ValueError(f"{len(self.completions)} completions but {len(self.rows)} rows")
        return self

    def pairs(self) -> tuple[list[str], list[dict[str, Any]]]:
        if self.samples is not None:
            return [s.completion for s in self.samples], [s.row for s in self.samples]
        return list(self.completions), list(self.rows or [{} for _ in self.completions])


class InlineRewardTestRequest(RewardTestRequest):
    spec: ServiceReward


class RewardTestResult(BaseModel):
    score: float | None
    error: str | None = None
    error_kind: str | None = None
    sub_scores: dict[str, float | None] = {}


class RewardTestErrors(BaseModel):
    count: int
    by_kind: dict[str, int]


class RewardTestTiming(BaseModel):
    total_seconds: float
    per_sample_seconds: float


class RewardTestObject(BaseModel):
    object: Literal["reward_function.test"] = "reward_function.test"
    results: list[RewardTestResult]
    scores: list[float | None]
    sub_scores: dict[str, list[float | None]]
    errors: RewardTestErrors
    timing: RewardTestTiming


# -- OpenAI graders --------------------------------------------------------------


class GraderRunRequest(Request):
    grader: dict[str, Any]
    model_sample: str = Field(max_length=200_000)
    item: Any = None


class GraderValidateRequest(Request):
    grader: dict[str, Any]
