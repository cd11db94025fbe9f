"""Probes: /healthz says the process answers; /readyz says it can reach what a request needs.

/readyz also reports how this host contains user code ("namespaces", or "none":
user Python is refused). That is informational: readiness is about the
database, the broker and the object store, so "none" does not fail it.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.repositories import health
from service.sandbox.probe import effective_level

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


def _check(name: str, probe) -> str:
    try:
        probe()
        return "ok"
    except Exception as e:  # any failure means not ready; the log says why, the body only which
        log.warning("readiness check %s failed: %s", name, e)
        return "failed"


def _database(request: Request) -> None:
    with request.app.state.sessions() as session:
        health.ping(session)


@router.get("/readyz")
def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    checks = {
        "database": _check("database", lambda: _database(request)),
        "broker": _check("broker", state.broker_ping),
        "object_store": _check("object_store", state.store.ping),
    }
    ready = all(v == "ok" for v in checks.values())
    settings = state.settings
    checks["sandbox"] = effective_level(settings.sandbox, settings.sandbox_uid, settings.sandbox_uid_count)
    return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks},
                        status_code=200 if ready else 503)
