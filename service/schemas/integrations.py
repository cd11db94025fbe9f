"""A job's experiment trackers: OpenAI's `integrations` field, with Weights & Biases in OpenAI's shape and MLflow
beside it. The worker logs each step's metrics and every evaluation to them (worker/tracking/trackers.py); a tracker
that breaks is switched off with a warn event, never failing the job. TensorBoard needs no entry: every job's
result files include a TensorBoard event file.

    {"type": "wandb", "wandb": {"project": "p", "name": "run", "entity": "team", "tags": ["a"]}}
    {"type": "mlflow", "mlflow": {"tracking_uri": "https://mlflow.example.com", "experiment": "cispo"}}
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f]+$")]
Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WandbSettings(_Strict):
    project: Name = Field(description="The W&B project the run is logged to.")
    name: Name | None = Field(None, description="The run's display name (default: the job id).")
    entity: Name | None = Field(None, description="The team or user owning the project (default: the key's).")
    tags: list[Tag] = Field([], max_length=50)


class MlflowSettings(_Strict):
    tracking_uri: str | None = Field(
        None, min_length=1, max_length=2048,
        description="An http(s) MLflow server, or a file: store under a directory the operator allows "
        "(CISPO_TRACKING_FILE_ROOTS); default: the worker's MLFLOW_TRACKING_URI.")
    experiment: Name = Field("cispo", description="The experiment's name (created when missing).")
    run_name: Name | None = Field(None, description="Default: the job id.")
    tags: dict[Tag, Annotated[str, Field(max_length=500)]] = Field({}, max_length=50)

    @field_validator("tracking_uri")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("http", "https", "file"):
            raise ValueError(f"{value!r}: an http(s) URL or a file: URI is required")
        return value


class Integration(_Strict):
    type: Literal["wandb", "mlflow"]
    wandb: WandbSettings | None = None
    mlflow: MlflowSettings | None = None

    @model_validator(mode="after")
    def _section_matches_type(self) -> Integration:
        if getattr(self, self.type) is None:
            raise ValueError(f"type is {self.type!r}, so its settings object {self.type!r} is required")
        other = "mlflow" if self.type == "wandb" else "wandb"
        if getattr(self, other) is not None:
            raise ValueError(f"type is {self.type!r}, so {other!r} must be left out")
        return self


Integrations = Annotated[list[Integration], Field(max_length=4)]
