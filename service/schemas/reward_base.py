"""What every reward spec shares: strict frozen models and the field types they reuse.

Separate from rewards.py so the modules that define groups of reward types
(reward_checks.py, reward_remote.py) and rewards.py, which joins them into
one union, do not import each other.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from service.schemas.templates import check_template


class RewardBase(BaseModel):
    # Same rules as job_spec.Strict; kept separate so job_spec can import the reward modules.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Template = Annotated[str, Field(max_length=20_000), AfterValidator(check_template)]
"""A string with ``{{ item.<path> }}`` / ``{{ sample.output_text }}`` variables (service/schemas/templates.py)."""

SecretName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,200}$",
                                  description="Name of a project secret (POST /v1/secrets); never its value.")]


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    if parts.username or parts.password:
        raise ValueError("credentials in the URL are not allowed; name a secret in auth_secret instead")
    return url


HttpUrl = Annotated[str, Field(max_length=2048), AfterValidator(_http_url)]
"""Syntax only: whether the address may be reached is decided by service/egress.py when it is used."""

HeaderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,100}$")]
