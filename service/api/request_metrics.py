"""Request counts and latency by route template, kept in process for GET /metrics.

Labels use the route template (/v1/fine_tuning/jobs/{fine_tuning_job_id}),
never the raw path, so ids neither leak into metrics nor explode their
number; a path that matched no route is counted as "unmatched". Each API
process keeps its own counters: Prometheus scrapes every replica and sums.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Anything else a client sends is counted as "OTHER", so made-up methods cannot grow the label set.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Seconds; spans a cached GET up to a slow upload.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def label_value(value: str) -> str:
    """Prometheus text format: backslash, double quote and newline are escaped inside label values."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RequestMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = defaultdict(int)
        self._buckets: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * len(BUCKETS))
        self._sums: dict[tuple[str, str], float] = defaultdict(float)
        self._totals: dict[tuple[str, str], int] = defaultdict(int)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self._counts[(method, route, str(status))] += 1
            buckets = self._buckets[(method, route)]
            for i, bound in enumerate(BUCKETS):
                if seconds <= bound:
                    buckets[i] += 1
            self._sums[(method, route)] += seconds
            self._totals[(method, route)] += 1

    def exposition(self) -> list[str]:
        lines = ["# HELP cispo_http_requests_total HTTP requests by method, route template and status.",
                 "# TYPE cispo_http_requests_total counter"]
        with self._lock:
            for (method, route, status), n in sorted(self._counts.items()):
                lines.append(f'cispo_http_requests_total{{method="{method}",route="{label_value(route)}",'
                             f'status="{status}"}} {n}')
            lines += ["# HELP cispo_http_request_duration_seconds HTTP request latency by method and route template.",
                      "# TYPE cispo_http_request_duration_seconds histogram"]
            for (method, route), buckets in sorted(self._buckets.items()):
                labels = f'method="{method}",route="{label_value(route)}"'
                for bound, n in zip(BUCKETS, buckets):
                    lines.append(f'cispo_http_request_duration_seconds_bucket{{{labels},le="{bound}"}} {n}')
                total = self._totals[(method, route)]
                lines += [f'cispo_http_request_duration_seconds_bucket{{{labels},le="+Inf"}} {total}',
                          f"cispo_http_request_duration_seconds_sum{{{labels}}} {self._sums[(method, route)]:.6f}",
                          f"cispo_http_request_duration_seconds_count{{{labels}}} {total}"]
        return lines


class RecordRequests:
    """ASGI middleware: times each HTTP request and records it under the route it matched."""

    def __init__(self, app: ASGIApp, *, metrics: RequestMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500  # an exception before any response is a 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in METHODS else "OTHER"
            self.metrics.observe(method, route, status, time.perf_counter() - start)
