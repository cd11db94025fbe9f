"""The JSON bodies the Tinker SDK (0.38) sends, as far as the API reads them before it writes a request row.

Fields the SDK adds that this service has no use for (its `type` tags, user metadata, console hints) are
ignored rather than refused: the SDK, not a person, writes these bodies, and a newer SDK adds fields. What the
runner needs beyond these it reads from the stored body itself.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

MAX_LORA_RANK = 256
MAX_SAMPLES = 128


class SdkBody(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(SdkBody):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = Field("", max_length=64)


class SessionRef(SdkBody):
    session_id: str = Field(max_length=40)


class LoraConfig(SdkBody):
    rank: int = Field(32, ge=1, le=MAX_LORA_RANK)
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(SdkBody):
    session_id: str = Field(max_length=40)
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1, max_length=512)
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    user_metadata: dict[str, Any] | None = None


class ModelRef(SdkBody):
    model_id: str = Field(min_length=1, max_length=120)


class ModelCall(ModelRef):
    """A training client's call: run in seq_id order on its model."""

    seq_id: int = Field(ge=1)


class AdamParams(SdkBody):
    learning_rate: float = Field(gt=0)


class OptimStep(ModelCall):
    adam_params: AdamParams = Field(validation_alias=AliasChoices("adam_params", "optim_params", "optimizer_params"))


class SaveWeights(ModelCall):
    path: str | None = Field(None, max_length=200)
    ttl_seconds: int | None = Field(None, ge=1)
    overwrite: bool = False


class SaveWeightsForSampler(ModelCall):
    path: str | None = Field(None, max_length=200)  # named: a checkpoint; None: a snapshot for one sampler
    sampling_session_seq_id: int | None = Field(None, ge=0)
    kind: str = "snapshot"
    ttl_seconds: int | None = Field(None, ge=1)


class LoadWeights(SdkBody):
    """Two addressings: a new model from a checkpoint (session_id, model_seq_id; the model's first call), or a
    load into an existing model (model_id, seq_id)."""

    model_id: str | None = Field(None, max_length=120)
    seq_id: int | None = Field(None, ge=1)
    session_id: str | None = Field(None, max_length=40)
    model_seq_id: int | None = Field(None, ge=0)
    path: str = Field(min_length=1, max_length=1024)
    optimizer: bool = False
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSession(SdkBody):
    session_id: str = Field(max_length=40)
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = Field(None, max_length=512)
    model_path: str | None = Field(None, max_length=1024)


class Sample(SdkBody):
    sampling_session_id: str | None = Field(None, max_length=120)
    seq_id: int | None = Field(None, ge=0)
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    prompt: dict[str, Any]
    sampling_params: dict[str, Any]
    base_model: str | None = Field(None, max_length=512)
    model_path: str | None = Field(None, max_length=1024)


class RetrieveFuture(SdkBody):
    request_id: str = Field(min_length=1, max_length=40)
    allow_metadata_only: bool = False
