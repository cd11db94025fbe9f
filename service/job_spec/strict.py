"""The base of every job-spec section (unknown fields refused) and the training-dtype rule they share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


def refuse_float16_training(value: str | None) -> str | None:
    """The training dtype: float16 is refused, since there is no loss scaling (gradients of a loss averaged over
    ~10^4 tokens underflow in float16). rollout.dtype may still be float16: sampling has no gradients."""
    if value == "float16":
        raise ValueError("float16 training is not supported (no loss scaling: gradients underflow); use "
                         "bfloat16, or float32 on a GPU without bfloat16 ('auto' picks for you)")
    return value


class Strict(BaseModel):
    """Base for every spec section: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
