"""Time, injectable. Every time the protocol compares (lease grant, deadlines, the commit gate,
the recovery loop's expiry) is read with `clock.now_in(conn)` inside the deciding transaction,
after its locks: in a deployment that is the database's clock (`clock_timestamp()`), one clock for
every replica, so a replica whose own clock is off changes no decision (DESIGN §3 Revisions, "One
clock"). Tests and the simulation pass a ManualClock, whose time stands for the database's and
moves only when told."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Connection, Engine

from ..store.db import database_now


class Clock(Protocol):
    def now(self) -> datetime:
        """For display and logs only (the dashboard's "now")."""
        ...

    def now_in(self, conn: Connection) -> datetime:
        """The protocol's time, read in the caller's transaction."""
        ...


class DatabaseClock:
    """The database's clock: the same for every replica."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine

    def now_in(self, conn: Connection) -> datetime:
        return database_now(conn)

    def now(self) -> datetime:
        if self.engine is None:
            return datetime.now(UTC)
        with self.engine.connect() as conn:
            return database_now(conn)


class ManualClock:
    """A clock that moves only when told to (thread-safe); stands for the database's clock."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def now_in(self, conn: Any) -> datetime:
        return self.now()

    def advance(self, *, ms: int = 0, seconds: float = 0) -> datetime:
        with self._lock:
            self._now += timedelta(milliseconds=ms, seconds=seconds)
            return self._now
