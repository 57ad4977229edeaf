"""Time, injectable. Every time the protocol compares (lease grant, deadlines, the commit gate,
the recovery loop's expiry) is read with `clock.now_in(conn)` inside the deciding transaction: in
a deployment that is the database's clock (`clock_timestamp()`), one clock for every replica, so
a replica whose own clock is off changes no decision (DESIGN §3 Revisions, "One clock"). Tests and
the simulation pass a ManualClock, whose time stands for the database's and moves only when told."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, text

_DB_NOW = text("SELECT clock_timestamp()")


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
        return _aware(conn.execute(_DB_NOW).scalar_one())

    def now(self) -> datetime:
        if self.engine is None:
            return datetime.now(UTC)
        with self.engine.connect() as conn:
            return self.now_in(conn)


class SystemClock:
    """This process's clock. Not for the protocol's comparisons (replicas' clocks differ); kept
    for callers that only display time."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def now_in(self, conn: Connection) -> datetime:
        return _aware(conn.execute(_DB_NOW).scalar_one())


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


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def now_from(clock: Clock, conn: Connection, read: datetime | None) -> datetime:
    """`clock.now_in(conn)`, without a round trip of its own when the clock is the database's and
    a statement of the same transaction already returned `clock_timestamp()` (`read`)."""
    if read is not None and isinstance(clock, (DatabaseClock, SystemClock)):
        return _aware(read)
    return clock.now_in(conn)


def given_now(clock: Clock, conn: Connection) -> datetime | None:
    """For a statement that reads the database's clock itself: None when the protocol's clock is
    the database's (the statement's read is it), else the clock's time to use instead."""
    if isinstance(clock, (DatabaseClock, SystemClock)):
        return None
    return clock.now_in(conn)
