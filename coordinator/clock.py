"""Time, injectable: the service reads `clock.now()` and never the system clock directly, so tests
and the simulation can move time to the edge of a transaction timeout."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to (thread-safe)."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, *, ms: int = 0, seconds: float = 0) -> datetime:
        with self._lock:
            self._now += timedelta(milliseconds=ms, seconds=seconds)
            return self._now
