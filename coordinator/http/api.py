"""REST API v1: a thin HTTP adapter over `Coordinator`. Authentication (dependencies.py), input
validation (input.py, schemas.py) and the mapping of protocol errors to status codes live here;
decisions do not. `create_app` assembles the routers of routes/, the operator dashboard, the docs
and the middleware."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from .. import __version__
from ..kafka.broker import PartitionWatch
from ..protocol import errors as e
from ..service import Coordinator, metrics
from .api_docs import mount_docs
from .dashboard import create_dashboard
from .dependencies import Tokens
from .input import InputRoute, body_limit, install_error_handlers
from .metrics import HttpMetricsMiddleware
from .routes import health, operator, protocol, reads, sinks


def create_app(coordinator: Coordinator, *, admin_token: str, token_secret: bytes,
               dashboard_viewer_token: str | None = None, dashboard_secure_cookie: bool = False) -> FastAPI:
    app = FastAPI(
        title="Spark -> Kafka exactly-once transaction coordinator",
        version=__version__,
        description="Two-phase commit of Kafka transactions tied to Spark micro-batches. "
        "Authenticate with `Authorization: Bearer <token>`: the admin token for sink management "
        "and operator actions, a sink's writer token for its protocol calls.",
        docs_url=None,
        redoc_url=None,
    )
    app.router.route_class = InputRoute
    mount_docs(app)  # /docs and /redoc from the package's assets, not a CDN
    app.state.coordinator = coordinator
    app.state.tokens = Tokens(admin_token, token_secret)
    app.state.body_limit = body_limit(coordinator.limits.max_partitions)  # the widest commit fits
    app.state.database_metrics = metrics.database_registry(coordinator.ctx.read)
    app.state.partition_watch = PartitionWatch()

    def count_fenced(exc: e.ProtocolError) -> None:
        if exc.status == 409:
            metrics.request_fenced(exc.reason)

    install_error_handlers(app, on_protocol_error=count_fenced)
    for module in (health, sinks, protocol, reads, operator):
        app.include_router(module.router)

    dashboard = create_dashboard(coordinator, admin_token=admin_token, token_secret=token_secret,
                                 viewer_token=dashboard_viewer_token, secure_cookie=dashboard_secure_cookie)
    app.mount("/dashboard", dashboard)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Starlette runs no lifespan of a mounted app: the dashboard's (it stops the broker watch's
        # threads) runs inside this one
        async with dashboard.router.lifespan_context(dashboard):
            yield

    app.router.lifespan_context = lifespan

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/", status_code=307)

    app.add_middleware(HttpMetricsMiddleware)
    return app
