"""The dashboard's read model: turns the service's reads into page data (no HTTP here).

Per-batch figures come from what the protocol records today: a committed batch's records and
bytes are the sums over its winning leases' pre-commits; its durations come from the attempt's
and checkpoint's timestamps. `DURATIONS` lists the duration columns and charts; a new recorded
figure (e.g. a per-lease write time) is one more entry there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ...protocol.model import Attempt, Checkpoint, Lease, Sink
from ...protocol.states import CheckpointState, LeaseState
from ...service import BatchSummary, Coordinator, LeasePage, PoolUsage
from .broker_watch import BrokerView, BrokerWatch
from .health import Health, Thresholds, TimeoutBar, ms_between, sink_health, timeout_bars

HISTORY = 50  # checkpoints per sink page (tables and charts)
EVENTS = 30  # newest events on a sink page
LEASES_SHOWN = 200  # leases on a checkpoint page at a time (a batch may have thousands)
DETAIL_ITEMS = 20  # items of a list in an event's detail on a page
BARS_SHOWN = 50  # open transactions drawn on a sink page, the nearest their timeout first
TOTALS_KEPT = 10_000  # decided batches' sums remembered, over all sinks
MIN_SLOTS = 12  # chart width in bars, at least


@dataclass(frozen=True)
class BatchRow:
    """One checkpoint as a table row and a chart point."""

    summary: BatchSummary
    durations: dict[str, int | None]  # DURATIONS key -> ms

    @property
    def checkpoint(self) -> Checkpoint:
        return self.summary.checkpoint

    @property
    def attempts(self) -> list[Attempt]:
        return self.summary.attempts

    @property
    def records(self) -> int | None:  # over the winning leases; None until a commit is decided
        return self.summary.records

    @property
    def bytes(self) -> int | None:
        return self.summary.bytes


def _ms(start: datetime | None, end: datetime | None) -> int | None:
    return None if start is None or end is None else ms_between(start, end)


# key, label, how to compute it (ms) from a checkpoint and its decided attempt
DURATIONS: list[tuple[str, str, Callable[[Checkpoint, Attempt | None], int | None]]] = [
    ("batch_ms", "batch (attempt start → decision)", lambda cp, a: _ms(a.started_at, a.decided_at) if a else None),
    ("job_ms", "Spark write job (reported by the driver)", lambda cp, a: a.job_ms if a else None),
    ("commit_ms", "commit latency (decision → committed)", lambda cp, a: _ms(cp.decided_at, cp.committed_at)),
    ("total_ms", "checkpoint (first begin → committed)", lambda cp, a: _ms(cp.created_at, cp.committed_at)),
]


def batch_row(b: BatchSummary) -> BatchRow:
    return BatchRow(summary=b, durations={key: f(b.checkpoint, b.decided_attempt) for key, _, f in DURATIONS})


@dataclass(frozen=True)
class Bar:
    label: str  # batch id
    value: float
    x: float
    y: float
    width: float
    height: float
    title: str


@dataclass(frozen=True)
class Chart:
    """A bar chart as inline SVG geometry (viewBox 0 0 WIDTH HEIGHT), oldest batch on the left."""

    key: str
    title: str
    unit: str
    bars: list[Bar]
    max_value: float

    WIDTH = 600
    HEIGHT = 160


def bar_chart(key: str, title: str, unit: str, points: Sequence[tuple[str, float | None]]) -> Chart:
    values = [(label, v) for label, v in points if v is not None]
    top = max((v for _, v in values), default=0) or 1
    slot = Chart.WIDTH / max(len(values), MIN_SLOTS)  # a few batches are not drawn as walls
    bars = []
    for i, (label, v) in enumerate(values):
        h = (Chart.HEIGHT - 20) * v / top
        bars.append(Bar(label, v, i * slot + slot * 0.1, Chart.HEIGHT - h, slot * 0.8, h, f"batch {label}: {v:g} {unit}"))
    return Chart(key, title, unit, bars, top)


def records_per_second(row: BatchRow) -> float | None:
    """Throughput of a batch's write job, when the driver reported its time (sparkclient does)."""
    job_ms = row.durations.get("job_ms")
    if row.records is None or not job_ms:
        return None
    return round(row.records * 1000 / job_ms, 1)


def charts(rows: Sequence[BatchRow]) -> list[Chart]:
    """Throughput and latency of the decided batches, oldest first."""
    decided = [r for r in reversed(rows) if r.records is not None]
    out = [
        bar_chart("records", "records per batch", "records", [(str(r.checkpoint.batch_id), r.records) for r in decided]),
        bar_chart("bytes", "bytes per batch", "bytes", [(str(r.checkpoint.batch_id), r.bytes) for r in decided]),
        bar_chart("records_per_s", "throughput (records / Spark write job)", "records/s",
                  [(str(r.checkpoint.batch_id), records_per_second(r)) for r in decided]),
    ]
    for key, label, _ in DURATIONS:
        out.append(bar_chart(key, label, "ms", [(str(r.checkpoint.batch_id), r.durations[key]) for r in decided]))
    return out


@dataclass(frozen=True)
class SinkSummary:
    sink: Sink
    health: Health
    last_committed: Checkpoint | None
    last_committed_age_ms: int | None
    open_transactions: int
    broker: BrokerView


@dataclass(frozen=True)
class SinkPage:
    summary: SinkSummary
    rows: list[BatchRow]
    charts: list[Chart]
    bars: list[TimeoutBar]  # the BARS_SHOWN nearest their timeout
    open_transactions: int  # all of them (a wide batch in flight has thousands)
    pool: PoolUsage
    events: list[dict[str, Any]]
    durations: list[tuple[str, str]] = field(default_factory=lambda: [(k, label) for k, label, _ in DURATIONS])


@dataclass(frozen=True)
class CheckpointPage:
    sink: Sink
    row: BatchRow
    attempt_numbers: dict[int, int]  # attempt id -> number
    leases: LeasePage  # LEASES_SHOWN of them at a time, of one state if asked
    lease_state: LeaseState | None
    events: list[dict[str, Any]]  # checkpoint_trail: the batch's events and what its rows record


def brief(detail: Any) -> Any:
    """An event's detail with every list cut to its first DETAIL_ITEMS (a wide batch's decision
    names thousands of winners; the API's event list has them all)."""
    if isinstance(detail, dict):
        return {k: brief(v) for k, v in detail.items()}
    if isinstance(detail, list):
        head = [brief(v) for v in detail[:DETAIL_ITEMS]]
        return head + [f"… {len(detail) - DETAIL_ITEMS:,} more"] if len(detail) > DETAIL_ITEMS else head
    return detail


def checkpoint_trail(batch: BatchSummary, events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batch's story, oldest first: its events (source "event") merged with what its rows
    record (source "record"): each attempt's start, and the commit's end. The protocol writes one
    event per batch on its common path (commit_decided); a plain begin and a commit finished by
    the call that decided it have no event of their own, their rows are their record. A commit
    finished later has a checkpoint_committed event (actor recovery), shown instead of the row's."""
    cp = batch.checkpoint
    trail = [(ev["at"], 1, dict(ev, source="event")) for ev in events]
    for a in batch.attempts:
        trail.append((a.started_at, 0, dict(
            id=None, at=a.started_at, kind="attempt_started", actor=None, batch_id=cp.batch_id, source="record",
            recorded_on="attempt", detail=dict(attempt=a.number, generation=a.generation, partitions=a.partitions),
        )))
    if cp.committed_at is not None and not any(ev["kind"] == "checkpoint_committed" for ev in events):
        trail.append((cp.committed_at, 2, dict(
            id=None, at=cp.committed_at, kind="checkpoint_committed", actor=None, batch_id=cp.batch_id,
            source="record", recorded_on="checkpoint", detail=dict(attempt=cp.committed_attempt),
        )))
    return [entry for _, _, entry in sorted(trail, key=lambda t: (t[0], t[1]))]


class Views:
    def __init__(self, coordinator: Coordinator, broker: BrokerWatch, thresholds: Thresholds = Thresholds()) -> None:
        self.coordinator = coordinator
        self.broker = broker
        self.thresholds = thresholds
        # (records, bytes) of decided attempts, by attempt id: they never change, and a sink page
        # of wide batches would sum hundreds of thousands of leases at every refresh
        self._totals: dict[int, tuple[int, int]] = {}
        self._totals_lock = threading.Lock()

    def _history(self, name: str) -> list[BatchSummary]:
        with self._totals_lock:
            known = dict(self._totals)
        history = self.coordinator.checkpoint_history(name, limit=HISTORY, known_totals=known)
        decided = {a.id: (b.records, b.bytes or 0) for b in history
                   if (a := b.decided_attempt) is not None and b.records is not None}
        with self._totals_lock:
            self._totals.update(decided)
            for stale in list(self._totals)[:max(0, len(self._totals) - TOTALS_KEPT)]:
                del self._totals[stale]  # the oldest entered first
        return history

    def now(self) -> datetime:
        return self.coordinator.clock.now()

    def _summary(self, sink: Sink, recent: Sequence[tuple[Checkpoint, Sequence[Attempt]]], last: Checkpoint | None,
                 open_transactions: int, unresolved: Sequence[Lease], now: datetime, broker: BrokerView) -> SinkSummary:
        """`unresolved`: at least the sink's unresolved leases that sink_health's rules read."""
        health = sink_health(
            sink, recent, unresolved, now,
            stuck_partitions=len(broker.stuck), lingering=len(broker.lingering), thresholds=self.thresholds,
        )
        age = ms_between(last.committed_at, now) if last is not None and last.committed_at is not None else None
        return SinkSummary(sink, health, last, age, open_transactions, broker)

    def overview(self) -> list[SinkSummary]:
        now = self.now()
        sinks = self.coordinator.sink_overviews(recent=5)  # a few queries for all sinks
        broker = self.broker.views([s.sink.name for s in sinks])
        return [self._summary(s.sink, s.recent, s.last_committed, s.open_transactions, s.near_timeout_candidates, now,
                              broker[s.sink.name]) for s in sinks]

    def sink_page(self, name: str) -> SinkPage:
        c = self.coordinator
        sink = c.get_sink(name)
        now = self.now()
        history = self._history(name)
        open_ = c.open_transactions_in_brief(name, BARS_SHOWN)
        rows = [batch_row(b) for b in history]
        bars = timeout_bars(open_.oldest, now, sink.transaction_timeout_ms, self.thresholds.near_timeout_fraction)
        events = c.recent_events(name, EVENTS)
        committed = c.list_checkpoints(name, state=CheckpointState.COMMITTED, limit=1)
        return SinkPage(
            summary=self._summary(sink, [(b.checkpoint, b.attempts) for b in history], committed[0] if committed else None,
                                  open_.count, open_.near_timeout_candidates, now, self.broker.view(name)),
            rows=rows,
            charts=charts(rows),
            bars=bars,
            open_transactions=open_.count,
            pool=c.pool_usage(name),
            events=events,
        )

    def checkpoint_page(self, name: str, batch_id: int, lease_state: LeaseState | None = None,
                        after_lease: int = 0) -> CheckpointPage:
        c = self.coordinator
        b = c.batch_summary(name, batch_id)
        return CheckpointPage(
            sink=c.get_sink(name),
            row=batch_row(b),
            attempt_numbers={a.id: a.number for a in b.attempts},
            leases=c.checkpoint_leases(name, batch_id, state=lease_state, after_id=after_lease, limit=LEASES_SHOWN),
            lease_state=lease_state,
            events=checkpoint_trail(b, c.list_events(name, batch_id=batch_id, limit=1000)),
        )
