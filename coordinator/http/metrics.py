"""HTTP request latency for /metrics: an ASGI middleware that records each request's duration by
route template (the coordinator's other metrics are in coordinator/service/metrics.py; /metrics
renders both)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Histogram
from starlette.routing import Mount

HTTP_DURATION = Histogram(
    "coordinator_http_request_duration_seconds",
    "HTTP request latency by method, route template (e.g. /v1/sinks/{name}/checkpoints/{batch_id}/begin) "
    "and status code",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)


class HttpMetricsMiddleware:
    """ASGI middleware: latency of every HTTP request by the matched route's path template (not
    the raw path, which would make a series per batch id), with the prefix of the mount it is in
    (the dashboard's "/sinks/{name}" is "/dashboard/sinks/{name}"). Unmatched paths count as "<unmatched>".
    Each series' child is looked up once and kept (the templates are a fixed set)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._children: dict[tuple[str, str, int], Any] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        root_path = scope.get("root_path", "")

        async def send_with_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")  # set by the (innermost) router on this scope when a route matched
            mounted = scope.get("root_path", "")[len(root_path):]  # each Mount passed adds its prefix
            if route is not None and not isinstance(route, Mount):
                template = mounted + route.path
            else:  # no route, or a mount that is not a router (static files): the mount's prefix
                template = mounted or "<unmatched>"
            key = (scope["method"], template, status)
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = HTTP_DURATION.labels(scope["method"], template, str(status))
            child.observe(time.perf_counter() - started)
