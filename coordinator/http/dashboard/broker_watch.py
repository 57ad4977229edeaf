"""The dashboard's view of the broker, per sink: stuck last stable offsets and lingering
transactions (coordinator/kafka/broker.py: `observe_partitions`, `lingering_transactions`).

A page must not hang on a slow or unreachable broker (the Kafka control plane retries for up to
its retry budget), so each sink's observation runs in a background thread: a page waits at most
`wait_s` for it and otherwise shows the previous observation (or "observing"). Observations are
reused for `ttl_s`; the stall of a partition is measured across observations by one
`PartitionWatch`, so a page refreshing every few seconds is what detects a stuck offset.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...kafka.broker import BlockingTransaction, PartitionWatch, StuckPartition
from ...kafka.control_plane import ControlPlaneError, OpenTransaction
from ...protocol import errors as e
from ...service.broker_checks import lingering_transactions, observe_partitions

if TYPE_CHECKING:
    from ...service import Coordinator


@dataclass(frozen=True)
class BrokerView:
    stuck: list[StuckPartition] = field(default_factory=list)
    blocking: list[BlockingTransaction] = field(default_factory=list)
    lingering: list[OpenTransaction] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be observed, and why
    observed_at: float | None = None  # monotonic; None: no observation finished yet


class BrokerWatch:
    def __init__(self, coordinator: Coordinator, *, min_stall_s: float = 60.0, ttl_s: float = 4.0,
                 wait_s: float = 2.0, watch: PartitionWatch | None = None) -> None:
        self.coordinator = coordinator
        self.min_stall_s = min_stall_s
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.watch = watch or PartitionWatch()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dashboard-broker")
        self._lock = threading.Lock()
        self._last: dict[str, BrokerView] = {}
        self._running: dict[str, Future[BrokerView]] = {}

    def view(self, sink: str) -> BrokerView:
        return self.views([sink])[sink]

    def views(self, sinks: Sequence[str]) -> dict[str, BrokerView]:
        """Every sink's view; the observations that are due all start before any is waited for,
        so a page of many sinks waits at most `wait_s` in all, not `wait_s` per sink."""
        due: dict[str, tuple[BrokerView | None, Future[BrokerView]]] = {}
        out: dict[str, BrokerView] = {}
        with self._lock:
            for sink in sinks:
                last = self._last.get(sink)
                if last is not None and last.observed_at is not None and time.monotonic() - last.observed_at < self.ttl_s:
                    out[sink] = last
                    continue
                future = self._running.get(sink)
                if future is None:
                    future = self._pool.submit(self._observe, sink)
                    self._running[sink] = future
                due[sink] = (last, future)
        deadline = time.monotonic() + self.wait_s
        for sink, (last, future) in due.items():
            try:
                out[sink] = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                out[sink] = last or BrokerView(notes=["observing the broker (no answer yet)"])
        return out

    def _observe(self, sink: str) -> BrokerView:
        try:
            view = self._observe_now(sink)
        except Exception as exc:  # shown on the page, never raised into it
            view = BrokerView(notes=[f"broker observation failed: {exc}"], observed_at=time.monotonic())
        with self._lock:
            self._last[sink] = view
            self._running.pop(sink, None)
        return view

    def _observe_now(self, name: str) -> BrokerView:
        c = self.coordinator
        if c.control_plane is None:
            return BrokerView(notes=["no Kafka control plane configured: the broker is not observed"],
                              observed_at=time.monotonic())
        notes: list[str] = []
        stuck: list[StuckPartition] = []
        blocking: list[BlockingTransaction] = []
        try:
            report = observe_partitions(c, name, self.watch, min_stall_s=self.min_stall_s)
            stuck, blocking, notes = report.stuck, report.blocking, list(report.notes)
        except (e.ProtocolError, ControlPlaneError) as exc:
            notes.append(f"last stable offsets not observed: {exc}")
        lingering: list[OpenTransaction] = []
        try:
            lingering = lingering_transactions(c, name)
        except ControlPlaneError as exc:
            notes.append(f"open transactions not listed: {exc}")
        return BrokerView(stuck, blocking, lingering, notes, time.monotonic())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
