"""training.stop_when: end a job early, as succeeded, when its evals say more steps will not pay off.

Torch-free, like the rest of the spec. The rule itself is worker/evals/stopping.py (a pure function).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PlateauSpec(_Strict):
    evals: int = Field(
        ge=1, le=1000,
        description="Stop after this many evals in a row none of which beat the best eval so far beyond that eval's "
        "95% interval (its mean above the best's upper bound). The step-0 baseline is the first best.")


class StopWhenSpec(_Strict):
    """Either rule or both; the first to fire ends the job (status succeeded, the reason in its events)."""

    plateau: PlateauSpec | None = Field(None, description="Stop when the eval reward has stopped improving.")
    target: float | None = Field(None, description="Stop once an eval's mean reward reaches this value.")

    @model_validator(mode="after")
    def _some_rule(self) -> StopWhenSpec:
        if self.plateau is None and self.target is None:
            raise ValueError("give plateau, target or both (leave stop_when out to train every step)")
        return self
