"""What every operation of the service works with: the engine, the Kafka control plane, the
clock and the limits, and the one way to run a database transaction."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from ..kafka.control_plane import KafkaControlPlane, KafkaTarget
from ..protocol import errors as e
from ..protocol.model import Sink
from .clock import Clock
from .results import Limits

# one logger for every part of the service package
log = logging.getLogger("coordinator.service")
T = TypeVar("T")

# Postgres codes worth retrying the whole transaction for: serialization failure, deadlock
_RETRYABLE_SQLSTATES = {"40001", "40P01"}


@dataclass
class ServiceContext:
    engine: Engine
    control_plane: KafkaControlPlane | None
    clock: Clock
    limits: Limits

    def transaction(self, fn: Callable[[Connection], T]) -> T:
        """fn in one database transaction, committed when it returns and rolled back if it raises;
        retried whole on a deadlock, a serialization failure or a connection found dead (safe: fn
        has no effect outside its transaction). A pooled connection is not pinged before use: one
        the database dropped fails its first statement and the transaction runs again."""
        return self._retried(fn, self.engine.begin)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """fn on a connection, for reads (their own snapshot per statement); retried as above."""
        return self._retried(fn, self.engine.connect)

    def _retried(self, fn: Callable[[Connection], T], connection: Callable[[], Any]) -> T:
        for attempt in range(5):
            try:
                with connection() as conn:
                    return fn(conn)
            except DBAPIError as exc:
                code = getattr(exc.orig, "sqlstate", None)
                if (code not in _RETRYABLE_SQLSTATES and not exc.connection_invalidated) or attempt == 4:
                    raise
                log.info("retrying a transaction after %s", code or "a lost database connection")
        raise AssertionError("unreachable")

    def plane(self) -> KafkaControlPlane:
        if self.control_plane is None:
            raise e.Unavailable(
                e.NO_CONTROL_PLANE,
                "the coordinator has no Kafka control plane configured (COORDINATOR_KAFKA_CONTROL_PLANE), "
                "so it cannot act on Kafka; nothing was decided",
            )
        return self.control_plane

    def commit_budget_ms(self, decided_at: datetime | None, now: datetime) -> int | None:
        """How long a finisher may retry a decided commit's EndTxn now: until the end of its retry
        window, counted from the decision (CommitReach), and at least one request. None: the
        control plane's own budget (no reach configured)."""
        reach = self.limits.commit_reach
        if reach is None or decided_at is None:
            return None
        left = reach.retry_window_ms - (now - decided_at) / timedelta(milliseconds=1)
        return int(max(reach.request_timeout_ms, min(reach.retry_budget_ms, left)))


def target(sink: Sink) -> KafkaTarget:
    return KafkaTarget(sink.name, sink.bootstrap_servers, sink.transaction_timeout_ms)
