"""Public shapes of /v1/environments: register an environment spec once, reference it from many jobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.schemas.api import Request, Text
from service.schemas.environments import EnvironmentSpec


class EnvironmentCreate(Request):
    name: Text = Field(min_length=1, max_length=200)
    spec: EnvironmentSpec


class EnvironmentObject(BaseModel):
    id: str
    object: Literal["environment"] = "environment"
    name: str
    type: str
    created_at: int
    spec: dict[str, Any]
