"""Errors the service layer raises, free of HTTP: the API maps each class to a status.

Every error names the request field it is about (`param`), so the client can
fix its request without guessing. Pydantic validation errors are turned into
the same shape by `describe_validation`, which also drops the union tags
pydantic puts into error locations ("spec.python.source" -> "spec.source").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from service.unsupported_fields import unknown_field_message

MAX_REPORTED_ERRORS = 5


class ServiceError(Exception):
    status = 400
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        if code is not None:
            self.code = code


class InvalidRequest(ServiceError):
    status = 400


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class Conflict(ServiceError):
    """An illegal state change or a resource still in use; retrying will not help."""

    status = 409
    code = "conflict"


class InUse(Conflict):
    """A registered object (a file, a reward function, an environment) that a job which has not finished names:
    deleting it would pull it from under the job."""

    def __init__(self, kind: str, object_id: str, job_id: str, *, param: str):
        super().__init__(f"{kind} {object_id} is used by job {job_id}, which has not finished; cancel it or wait",
                         param=param, code=f"{param.removesuffix('_id')}_in_use")


class InvalidValue(InvalidRequest):
    """A field whose value fails validation. 400 like every invalid request (OpenAI's convention, which its SDK
    raises as BadRequestError), whichever layer found it: the request model, the JobSpec, or a service check."""

    code = "invalid_value"


class TooManyRequests(ServiceError):
    """A limit that frees up with time: the client may retry after `retry_after_s` seconds."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, param: str | None = None, code: str | None = None):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s


_MISSING = object()


def field_path(loc: Sequence[Any], data: Any = _MISSING) -> str:
    """A dotted path for a pydantic error location, walking `data` to tell fields from union tags.

    Pydantic puts the tag of a discriminated union ('python', 'cosine') and
    the member label of a plain union ('int', "literal['auto']") into the
    location; neither is a field the client wrote, so both are dropped.
    """
    parts: list[str] = []
    node = _MISSING if data is None else data
    for i, seg in enumerate(loc):
        if isinstance(node, dict):
            if node.get("type") == seg and i + 1 < len(loc) and loc[i + 1] in node:
                continue  # the tag, though a field has its name too ({"type": "json_schema", "json_schema": ...})
            if seg in node:
                parts.append(str(seg))
                node = node[seg]
                continue
            if node.get("type") == seg:
                continue  # the tag of a discriminated union
            parts.append(str(seg))
            node = _MISSING
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            parts.append(f"[{seg}]")
            node = node[seg]
        elif node is _MISSING:
            parts.append(f"[{seg}]" if isinstance(seg, int) else str(seg))
        else:
            break  # a scalar: what follows labels a union member, not a field
    return ".".join(parts).replace(".[", "[")


def _message(err: dict) -> str:
    msg = str(err.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if err.get("type") == "extra_forbidden":
        msg = unknown_field_message((err.get("loc") or ("",))[-1])
    return msg


def describe_validation(errors: Iterable[dict], data: Any = _MISSING, *,
                        path: Callable[[str], str] = lambda p: p) -> tuple[str, str | None]:
    """(message, param) for a list of pydantic errors: 'a.b: what is wrong; c: ...'.

    An error may carry a ready-made "path"; otherwise its loc is walked against `data`.
    """
    by_path: dict[str, list[str]] = {}
    for err in errors:
        p = path(err["path"] if "path" in err else field_path(err.get("loc", ()), data))
        msgs = by_path.setdefault(p, [])
        if (m := _message(err)) not in msgs:
            msgs.append(m)
    items = list(by_path.items())
    parts = [f"{p or 'body'}: {' or '.join(msgs)}" for p, msgs in items[:MAX_REPORTED_ERRORS]]
    if len(items) > MAX_REPORTED_ERRORS:
        parts.append(f"and {len(items) - MAX_REPORTED_ERRORS} more")
    return "; ".join(parts), (items[0][0] or None) if items else None


def invalid_value(err: ValidationError, data: Any = _MISSING, *,
                  path: Callable[[str], str] = lambda p: p) -> InvalidValue:
    message, param = describe_validation(err.errors(), data, path=path)
    return InvalidValue(message, param=param)
