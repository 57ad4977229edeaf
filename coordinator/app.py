"""Wiring: settings -> engine, control plane, service, HTTP app. `create_app_from_env` is the
factory uvicorn calls in every worker process."""

from __future__ import annotations

import logging

from fastapi import FastAPI

from .api import create_app
from .kafka_control import build_control_plane
from .service import Coordinator, Limits
from .settings import Settings
from .store.db import make_engine


def build_coordinator(settings: Settings) -> Coordinator:
    if settings.database_url is None:
        raise ValueError("COORDINATOR_DATABASE_URL is not set")
    return Coordinator(
        make_engine(settings.database_url, pool_size=settings.db_pool_size),
        build_control_plane(settings.kafka_control_plane, **settings.kafka_options()),
        limits=Limits(
            max_partitions=settings.max_partitions,
            broker_max_transaction_timeout_ms=settings.broker_max_transaction_timeout_ms,
            restart_budget_ms=settings.restart_budget_ms,
        ),
    )


def create_app_from_env() -> FastAPI:
    settings = Settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.admin_token is None:
        raise ValueError("COORDINATOR_ADMIN_TOKEN is not set")
    return create_app(
        build_coordinator(settings),
        admin_token=settings.admin_token.get_secret_value(),
        token_secret=settings.writer_token_secret(),
    )
