"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ...service import metrics
from ...store.db import schema_is_current
from ..dependencies import Service
from ..input import ErrorOut, InputRoute

router = APIRouter(route_class=InputRoute, tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorOut, "description": "not ready (error.reason says why)"}})
def readyz(coordinator: Service) -> JSONResponse:
    """Readiness: the database answers and its schema is at the current migration."""
    try:
        current = coordinator.ctx.read(schema_is_current)
    except Exception as exc:  # any database failure means not ready
        return JSONResponse(status_code=503, content={"error": {"reason": "database_unavailable", "message": str(exc)}})
    if not current:
        return JSONResponse(status_code=503,
                            content={"error": {"reason": "schema_not_current", "message": "run `coordinator migrate`"}})
    plane = coordinator.control_plane.name if coordinator.control_plane else "unconfigured"
    return JSONResponse({"status": "ready", "kafka_control_plane": plane})


@router.get("/metrics", response_class=Response)
def prometheus_metrics(request: Request) -> Response:
    """Prometheus metrics of this process and of the database's state (coordinator/service/metrics.py)."""
    body, content_type = metrics.render(request.app.state.database_metrics)
    return Response(content=body, media_type=content_type)
