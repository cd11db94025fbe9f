"""Request counts and latency by route template, for GET /metrics, kept by prometheus_client.

Labels use the route template (/v1/fine_tuning/jobs/{fine_tuning_job_id}),
never the raw path, so ids neither leak into metrics nor explode their
number; a path that matched no route is counted as "unmatched".

One API process keeps its counters in its app's registry. Several worker
processes behind one port (uvicorn --workers) set PROMETHEUS_MULTIPROC_DIR to
an empty directory shared by them before they start: prometheus_client then
keeps each process's values in files there, and a scrape, whichever worker
answers it, sums them all. Separate replicas are scraped one by one and summed
by Prometheus.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Anything else a client sends is counted as "OTHER", so made-up methods cannot grow the label set.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Seconds; spans a cached GET up to a slow upload.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable, read when it is imported


class RequestMetrics:
    """One app's HTTP metrics; a registry per app, so several apps in one process (tests) count apart."""

    def __init__(self) -> None:
        self._registry = CollectorRegistry()
        self._requests = Counter("cispo_http_requests_total", "HTTP requests by method, route template and status.",
                                 ("method", "route", "status"), registry=self._registry)
        self._latency = Histogram("cispo_http_request_duration_seconds",
                                  "HTTP request latency by method and route template.", ("method", "route"),
                                  buckets=BUCKETS, registry=self._registry)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self._requests.labels(method, route, str(status)).inc()
        self._latency.labels(method, route).observe(seconds)

    def registry(self) -> CollectorRegistry:
        """What a scrape reads: this process's registry, or every worker's files in multiprocess mode."""
        if not os.environ.get(MULTIPROCESS_DIR):
            return self._registry
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        return merged


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
