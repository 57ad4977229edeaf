"""Wiring: settings -> engine, control plane, service, HTTP app. `create_app_from_env` is the
factory uvicorn calls in every worker process."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from fastapi import FastAPI

from .http.api import create_app
from .kafka import build_control_plane
from .logs import limit_repeats
from .service.recovery import RecoveryLoop
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
            lease_max_init_age_ms=settings.lease_max_init_age_ms,
            producer_init_timeout_ms=settings.producer_init_timeout_ms,
            producer_request_timeout_ms=settings.producer_request_timeout_ms,
            transactional_id_quarantine_ms=settings.transactional_id_quarantine_ms,
            commit_reach=settings.commit_reach(),
        ),
    )


def create_app_from_env() -> FastAPI:
    settings = Settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_repeats(settings.log_level)  # an unreachable broker: a line per interval, not per retry
    if settings.admin_token is None:
        raise ValueError("COORDINATOR_ADMIN_TOKEN is not set")
    coordinator = build_coordinator(settings)
    app = create_app(
        coordinator,
        admin_token=settings.admin_token.get_secret_value(),
        token_secret=settings.writer_token_secret(),
        dashboard_viewer_token=(
            settings.dashboard_viewer_token.get_secret_value() if settings.dashboard_viewer_token else None
        ),
        dashboard_secure_cookie=settings.dashboard_secure_cookie,
    )
    if settings.recovery_enabled:
        loop = RecoveryLoop(
            coordinator, interval_ms=settings.recovery_interval_ms, leader_ttl_ms=settings.recovery_leader_ttl_ms,
            finish_grace_ms=settings.commit_reach().recovery_grace_ms,
            history_retention=(timedelta(hours=settings.history_retention_hours)
                               if settings.history_retention_hours else None),
            sweep_interval_ms=settings.recovery_sweep_interval_ms,
        )
        with_recovery_loop(app, loop)
    else:
        logging.getLogger(__name__).warning(
            "COORDINATOR_RECOVERY_ENABLED=false: this process never runs the recovery loop; decided commits "
            "finish only when a driver resumes them, and nothing sweeps lingering transactions"
        )
    settle_gc()
    return app


# Collections start when the tracked objects alive have grown by this many since the last one.
# Python's 700 started one in the middle of most 200-partition calls, which walked the call's
# own records (alive until it answers, garbage right after): in a 10-s run over HTTP the busier
# worker ran ~3,150 young and ~26 full collections, ~5% of its CPU (~1% at 2 partitions). At
# 50,000 the workers ran none after starting (bench/README.md, twenty-second round). Cyclic
# garbage waits longer for its collection: at most that many objects, a few MB.
GC_THRESHOLD = 50_000


def settle_gc() -> None:
    """The garbage collector's settings for a process that serves the protocol, once it is built.
    The imports and the app leave ~130k objects that live as long as the process. Every full
    collection walked them all: ~60 ms with the GIL held, about once a second under 200-partition
    batches (their calls' p99). Frozen, collections skip them (garbage among them goes first)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])


def with_recovery_loop(app: FastAPI, loop: RecoveryLoop) -> FastAPI:
    """Run the loop's thread for the app's lifetime (around any lifespan the app already has).
    At shutdown the Kafka control plane is closed first: a step retrying an unreachable broker
    ends at once instead of running out its retry budget (SIGTERM takes seconds)."""
    inner = app.router.lifespan_context
    app.state.recovery_loop = loop

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        loop.start()
        try:
            async with inner(a) as state:
                yield state
        finally:
            if loop.coordinator.control_plane is not None:
                loop.coordinator.control_plane.close()
            loop.stop()

    app.router.lifespan_context = lifespan
    return app
