"""GET /dashboard: one static page (no build step, nothing fetched from outside the API).

The page asks for the API key, or takes it from the address's fragment
(`/dashboard#key=sk-...`, which browsers never send to the server), and keeps
it in the browser's localStorage, removing it from the address at once; it
sends it only as an Authorization header to /v1, so it never lands in an
access log. Every response carries a strict Content-Security-Policy:
scripts and styles from this origin only, no inline code, no framing, so an
injected string that slipped past the page's escaping still cannot run.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from service.errors import NotFound

router = APIRouter(include_in_schema=False)

STATIC = Path(__file__).parent / "static"
ASSETS = {"app.js": "text/javascript", "app.css": "text/css", "favicon.svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",  # revalidate, so an upgraded service never runs a stale script
}


@router.get("/dashboard")
def dashboard() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=SECURITY_HEADERS)


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    """What browsers ask every site for: the dashboard's icon (browsers take an SVG at this path too)."""
    return asset("favicon.svg")


@router.get("/dashboard/static/{name}")
def asset(name: str) -> FileResponse:
    if name not in ASSETS:  # a fixed list: no path from the URL ever reaches the file system
        raise NotFound(f"no dashboard asset {name!r}", param="name")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=SECURITY_HEADERS)
