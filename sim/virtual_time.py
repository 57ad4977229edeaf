"""The recovery loop's workers in simulated time. The loop hands each sink's work to a worker of a
pool; in a deployment the workers run at once, so one sink's slow Kafka calls delay only the work
on the same worker. The simulation is single-threaded (a seed replays the same schedule), so a
`VirtualPool` runs each job at once, in order, but keeps the time each worker is busy: a job
starts when its worker is free (the shared clock moves on to then if that is later), and the
time the model charged for calls to an unreachable cluster (`ModelControlPlane.busy_ms`) keeps
that worker busy, not the others."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import Any, Protocol


class Timeline(Protocol):
    def now(self) -> datetime: ...
    def advance(self, ms: int) -> None: ...
    def busy_ms(self) -> int: ...
    def reset_busy(self) -> None: ...


class VirtualPool:
    def __init__(self, workers: int, timeline: Timeline) -> None:
        self.timeline = timeline
        self.free_at: list[datetime | None] = [None] * workers  # when each worker is free again

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        t = self.timeline
        now = t.now()
        i = min(range(len(self.free_at)), key=lambda k: self.free_at[k] or now)
        start = max(now, self.free_at[i] or now)
        if start > now:
            t.advance(int((start - now) / timedelta(milliseconds=1)))
        t.reset_busy()
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as a pool would
            future.set_exception(exc)
        self.free_at[i] = start + timedelta(milliseconds=t.busy_ms())
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass
