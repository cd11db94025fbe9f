"""OpenAI's error envelope, {"error": {message, type, param, code}}, for every failure.

The openai SDK reads `body["error"]` and retries 409 unless told not to, so
illegal state changes carry `x-should-retry: false`. A 500 says nothing about
the cause (the log has it): no stack traces leave the process.
"""

from __future__ import annotations

import json
import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException

from service.api import json_body
from service.errors import ServiceError, describe_validation, field_path
from service.repositories.pagination import UnknownCursor
from service.storage import NotFound as ObjectNotFound
from service.storage import StorageError

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    headers = dict(headers or {})
    if status == 409:
        headers["x-should-retry"] = "false"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _strip_source(loc) -> tuple:
    # FastAPI prefixes where the value came from; the client knows the field by name only.
    return tuple(loc[1:]) if loc and loc[0] in ("body", "query", "path", "header", "cookie") else tuple(loc)


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if bad_json := next((e for e in errors if e.get("type") == "json_invalid"), None):
        detail = (bad_json.get("ctx") or {}).get("error", "invalid JSON")
        where = _strip_source(bad_json.get("loc", ()))
        at = f" at position {where[0]}" if where else ""
        return error_response(400, f"the request body is not valid JSON ({detail}{at})", code="invalid_json")
    body = exc.body
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except ValueError:
            body = None
    if not isinstance(body, (dict, list)):
        body = None  # e.g. form data: nothing to walk, the error location is the field
    located = [{**e, "path": field_path(_strip_source(e.get("loc", ())),
                                        body if e.get("loc", ("",))[0] == "body" else None)} for e in errors]
    message, param = describe_validation(located)
    return error_response(400, message, param=param, code="invalid_value")  # as InvalidValue: one code for bad input


def service_error_response(exc: ServiceError) -> JSONResponse:
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"retry-after": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=headers)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return service_error_response(exc)


async def _unknown_cursor(request: Request, exc: UnknownCursor) -> JSONResponse:
    # Raised for ids that do not exist and for ids the caller may not see: the two look alike.
    return error_response(400, f"after: unknown cursor {exc.args[0]!r} (use an id from a previous page)",
                          param="after", code="invalid_cursor")


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 400 and (why := json_body.unreadable(exc.__cause__)) is not None:
        return error_response(400, why, code="invalid_json")  # FastAPI's own parse of a route's body
    if exc.status_code == 404 and message == "Not Found":
        message = f"no route for {request.method} {request.url.path}"
    return error_response(exc.status_code, message, code=getattr(exc, "code", None),
                          headers=getattr(exc, "headers", None))


async def _storage(request: Request, exc: StorageError) -> JSONResponse:
    if isinstance(exc, ObjectNotFound):
        log.error("object %s is missing from the store (%s %s)", exc.key, request.method, request.url.path)
        return error_response(404, "the stored content of this resource is missing", code="content_missing")
    log.exception("object store failure on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(503, "the object store is unavailable; try again later", code="storage_unavailable",
                          headers={"retry-after": "5"})


async def _database(request: Request, exc: OperationalError) -> JSONResponse:
    return database_unavailable(request.method, request.url.path, exc)


def database_unavailable(method: str, path: str, exc: OperationalError) -> JSONResponse:
    log.exception("database failure on %s %s", method, path, exc_info=exc)
    return error_response(503, "the database is unavailable or busy; try again later", code="database_unavailable",
                          headers={"retry-after": "5"})


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error; the request was not completed", code="internal_error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(UnknownCursor, _unknown_cursor)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(StorageError, _storage)
    app.add_exception_handler(OperationalError, _database)
    app.add_exception_handler(Exception, _unexpected)
