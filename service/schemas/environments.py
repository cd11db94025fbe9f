"""Environment specs a job may name: multi-turn tasks the policy acts in, turn by turn.

Torch-free and never runs user code: the API validates these specs, the
worker runs them (worker/envs/). Two kinds speak one protocol:

    reset(seed, row) -> observation
    step(action)     -> (observation, reward, terminated, truncated, info)

- ``python``: user source defining a class with those two methods, hosted in
  a sandboxed child process (like ``python`` rewards); one instance per
  episode, constructed with no arguments. Validation here compiles the source
  and checks the class with ``ast``; it never executes it.
- ``http``: a remote server. ``POST {url}/reset`` with ``{episode_id, seed,
  row}`` answers ``{observation}``; ``POST {url}/step`` with ``{episode_id,
  action}`` answers ``{observation, reward, terminated, truncated, info}``.
  ``reset`` must be idempotent per episode id (it may be retried). With
  ``auth_secret``, the named project secret's value is sent as ``header``
  (store e.g. "Bearer abc"); the spec never holds the value. The URL is
  egress-checked when registered and again when a job uses it.

An observation is the next user turn: a string, or a list of chat messages
``{"role", "content"}``. An action is the assistant's decoded text.
"""

from __future__ import annotations

import ast
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from service.schemas.python_source import check_identifier, check_source

from service.schemas.reward_base import HeaderName, SecretName



class _EnvironmentBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _methods(tree: ast.Module, class_name: str) -> set[str] | None:
    """Method names a top-level class defines, including those of base classes defined in the same source."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if class_name not in classes:
        return None
    found: set[str] = set()
    todo, seen = [class_name], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in classes:
            continue
        seen.add(name)
        node = classes[name]
        found |= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        todo += [b.id for b in node.bases if isinstance(b, ast.Name)]
    return found


class PythonEnvironment(_EnvironmentBase):
    """User Python source defining ``class_name`` with ``reset(self, seed, row)`` and ``step(self, action)``.

    ``reset`` returns the first observation (a string: the user turn; a list of chat messages; or None: the
    row's prompt), or Gymnasium's ``(observation, info)``. ``step`` returns ``(observation, reward,
    terminated, truncated, info)``; the observation may be None once the episode is over. ``info`` is not used.

    It runs in a sandboxed child process with the standard library only. A
    call that raises, times out, or returns something outside the protocol
    ends that episode with the job's failure score, counted as an error.
    """

    type: Literal["python"] = "python"
    source: str = Field(description="Python source, at most 256 KiB of UTF-8.")
    class_name: str = Field("Environment", description="Top-level class to instantiate, once per episode.")
    timeout_s: float = Field(10.0, gt=0.0, le=300.0, description="Limit for one reset() or step() call.")
    memory_mb: int = Field(1024, ge=256, le=65536, description="Address-space limit of the child process.")

    @field_validator("source")
    @classmethod
    def _compiles(cls, source: str) -> str:
        return check_source(source, "<environment>")

    @field_validator("class_name")
    @classmethod
    def _identifier(cls, name: str) -> str:
        return check_identifier(name, "class_name")

    @model_validator(mode="after")
    def _defines_class(self) -> PythonEnvironment:
        methods = _methods(ast.parse(self.source, "<environment>"), self.class_name)
        if methods is None:
            raise ValueError(f"class {self.class_name!r} is not defined (needs a top-level class)")
        missing = [m for m in ("reset", "step") if m not in methods]
        if missing:
            raise ValueError(f"class {self.class_name!r} must define {' and '.join(missing)} "
                             "(plain def methods: reset(self, seed, row), step(self, action))")
        return self


class HttpEnvironment(_EnvironmentBase):
    """A remote environment server; see the module docstring for the protocol."""

    type: Literal["http"] = "http"
    url: str = Field(max_length=2048, description="Base URL; the worker POSTs to {url}/reset and {url}/step.")
    auth_secret: SecretName | None = Field(
        None, description="Name of a project secret whose value is sent as the `header` (e.g. 'Bearer abc').",
    )
    header: HeaderName = "Authorization"
    timeout_s: float = Field(30.0, gt=0.0, le=300.0, description="Limit for one request.")
    max_retries: int = Field(
        2, ge=0, le=10, description="Retries of a failed reset, and of a step that never reached the server.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url {url!r} must be an http(s) URL with a host")
        if parts.username or parts.password:
            raise ValueError("url must not carry credentials; name a secret in auth_secret instead")
        if parts.query or parts.fragment:
            raise ValueError("url must not have a query or fragment (the worker appends /reset and /step)")
        if re.search(r"[\s\x00-\x1f\x7f]", url):
            raise ValueError("url must not contain whitespace or control characters")
        return url.rstrip("/")


EnvironmentSpec = Annotated[PythonEnvironment | HttpEnvironment, Field(discriminator="type")]
"""The environment specs the service and the trainer accept."""


def _ref_kind(value) -> str | None:
    if isinstance(value, str):
        return "id"
    if isinstance(value, dict):
        return value.get("type")
    return getattr(value, "type", None)


EnvironmentRef = Annotated[
    Annotated[str, Tag("id"), Field(min_length=1, max_length=40)]
    | Annotated[PythonEnvironment, Tag("python")]
    | Annotated[HttpEnvironment, Tag("http")],
    Discriminator(_ref_kind, custom_error_type="invalid_environment",
                  custom_error_message="must be a registered environment id (env-...) or an inline spec with "
                                       "type 'python' or 'http'"),
]
"""What a job names: a registered environment's id, or an inline spec (errors point into the spec's fields)."""
