"""The coordinator's Prometheus metrics, all in one place (served at /metrics).

Two kinds:
- Event-derived counters and histograms, recorded where the event happens (commits, aborts,
  refused requests, the recovery loop; HTTP request latency is coordinator/http/metrics.py's). They are per process: with several
  replicas, sum them in Prometheus. The recovery loop's come only from the replica that leads it
  (`coordinator_recovery_leader` is 1 there).
- State-derived gauges (open transactions, the oldest one's age, checkpoints by state), computed
  from the database at scrape time by `DatabaseCollector`, so every replica reports the same
  truth (store/gauges.py), cached for `ttl_s` so a burst of scrapes costs one read.

Names follow Prometheus conventions: counters end in `_total` (prometheus_client adds it to the
names below), durations are histograms in `_seconds`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Connection

from ..protocol.states import MAY_HOLD_TRANSACTION, LeaseState
from ..store import gauges

log = logging.getLogger(__name__)

CHECKPOINTS_LOST = Counter(
    "coordinator_checkpoints_lost",
    "Checkpoints whose decided commit Kafka refused for good (data lost; the sink is halted)",
    ["sink"],
)
TRANSACTIONS_LOST = Counter(
    "coordinator_transactions_lost",
    "Winning transactions whose commit Kafka refused for good (fenced, timed out, unknown producer)",
    ["sink"],
)
OFFSETS_MISMATCH = Counter(
    "coordinator_offsets_mismatch",
    "Begins refused because the batch was planned over other offsets than at its first begin "
    "(a checkpoint location restored from an older backup): alert on any increase",
    ["sink"],
)
OFFSETS_UNCHECKED = Counter(
    "coordinator_offsets_unchecked",
    "Begins of a batch begun before whose offsets could not be checked (no digest on one side: the "
    "writer's offsets.binding=off)",
    ["sink"],
)
LOST_DATA_ACKNOWLEDGED = Counter(
    "coordinator_lost_data_acknowledged",
    "Operator acknowledgements that cleared a sink's lost-data halt",
    ["sink"],
)
LINGERING_FOUND = Counter(
    "coordinator_lingering_transactions_found",
    "Open transactions under a sink's prefix that the database does not explain",
    ["sink"],
)
LINGERING_ABORTED = Counter(
    "coordinator_lingering_transactions_aborted",
    "Lingering transactions the recovery loop aborted",
    ["sink"],
)
TRANSACTION_TIMEOUT_WARNINGS = Counter(
    "coordinator_transaction_timeout_warnings",
    "Pre-committed transactions seen past the warning fraction (80%) of their timeout",
    ["sink"],
)
TRANSACTIONS_NEAR_TIMEOUT = Gauge(
    "coordinator_transactions_near_timeout",
    "Pre-committed or committing transactions now past the warning fraction of their timeout "
    "(set by the recovery loop's leader at each iteration)",
    ["sink"],
)
EXPIRED_LEASES_ABORTED = Counter(
    "coordinator_expired_leases_aborted",
    "Leases of open attempts marked for abort because their transaction can no longer be committed",
    ["sink"],
)
RECOVERED_COMMITS = Counter(
    "coordinator_recovery_commits_finished",
    "Decided commits the recovery loop finished",
    ["sink"],
)
RECOVERY_LEADER = Gauge("coordinator_recovery_leader", "1 while this process leads the recovery loop")
RECOVERY_ITERATIONS = Counter("coordinator_recovery_iterations", "Recovery loop iterations run as leader")
RECOVERY_ERRORS = Counter("coordinator_recovery_errors", "Recovery loop steps that failed", ["step"])
HISTORY_PRUNED = Counter("coordinator_history_pruned_batches",
                         "Committed batches whose attempts, leases and events were pruned (their rows stay)", ["sink"])

# --- protocol outcomes (recorded by service/ through the functions below) ------------------------

CHECKPOINT_OUTCOMES = Counter(
    "coordinator_checkpoint_outcomes",
    "Checkpoint attempts ended, by outcome: committed (the checkpoint became COMMITTED), lost (Kafka "
    "refused a decided commit), aborted (the driver or an operator aborted the attempt), "
    "deadline_refused (the commit gate refused it: a winner was too close to its transaction timeout)",
    ["sink", "outcome"],
)
# Kafka EndTxn / InitProducerId take milliseconds on a healthy cluster and up to the retry budget
# (30 s by default) when the broker is unreachable.
_KAFKA_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COMMIT_DURATION = Histogram(
    "coordinator_commit_duration_seconds",
    "Time to finish a decided commit: every winner committed on Kafka by resume (in parallel) and "
    "the result recorded, whatever the outcome",
    ["sink"],
    buckets=_KAFKA_BUCKETS,
)
ABORT_DURATION = Histogram(
    "coordinator_abort_duration_seconds",
    "Time to abort one transaction on Kafka (InitProducerId on its transactional id), whatever the outcome",
    ["sink"],
    buckets=_KAFKA_BUCKETS,
)
FENCED_REQUESTS = Counter(
    "coordinator_fenced_requests",
    "API calls refused with 409 because they are stale or contradict the record (they changed "
    "nothing), by the answer's reason: stale_generation, stale_attempt, stale_lease, lineage_mismatch, ...",
    ["reason"],
)
PARTITION_LSO_LAG = Gauge(
    "coordinator_partition_lso_lag_records",
    "High watermark minus last stable offset of a sink's output partition: records read_committed "
    "consumers cannot read yet (an open transaction holds them), as last observed by this process",
    ["sink", "topic", "partition"],
)


def checkpoint_outcome(sink: str, outcome: str) -> None:
    CHECKPOINT_OUTCOMES.labels(sink, outcome).inc()


def commit_finished(sink: str, seconds: float | None, *, committed: bool, lost: bool) -> None:
    """One finishing of a decided commit: its duration (None: it had no winner left to commit on
    Kafka), and the checkpoint's outcome if this call is the one that moved it to COMMITTED or
    LOST (concurrent finishers count it once)."""
    if seconds is not None:
        COMMIT_DURATION.labels(sink).observe(seconds)
    if committed:
        CHECKPOINT_OUTCOMES.labels(sink, "committed").inc()
    if lost:
        CHECKPOINT_OUTCOMES.labels(sink, "lost").inc()


def kafka_abort_finished(sink: str, seconds: float) -> None:
    ABORT_DURATION.labels(sink).observe(seconds)


def request_fenced(reason: str) -> None:
    FENCED_REQUESTS.labels(reason).inc()


def partitions_observed(sink: str, partitions: Iterable[Any]) -> None:
    """Set the LSO lag of each observed partition (kafka.control_plane.PartitionStability)."""
    for p in partitions:
        PARTITION_LSO_LAG.labels(sink, p.topic, str(p.partition)).set(max(0, p.high_watermark - p.last_stable_offset))


# gauges of a sink's state as this process last saw it; a retired sink's would keep their last value
LAST_SEEN_BY_SINK = (TRANSACTIONS_NEAR_TIMEOUT, PARTITION_LSO_LAG)


def forget_sink(sink: str) -> None:
    """Drop a retired sink's last-seen gauges (a halt seen before its retirement stayed 1 until
    the process restarted). Its counters stay: they are its history."""
    for gauge in LAST_SEEN_BY_SINK:
        gauge.remove_by_labels({"sink": sink})


# --- state from the database, at scrape time -----------------------------------------------------

OPEN_STATES = tuple(s.value for s in LeaseState if s in MAY_HOLD_TRANSACTION)
# checkpoints still in flight or needing attention; COMMITTED ones are counted by the outcome counter
CHECKPOINT_STATES = ("OPEN", "COMMITTING", "LOST")


class DatabaseCollector(Collector):
    """Gauges read from the database at scrape time (one per app, in its own registry)."""

    def __init__(self, read: Callable[[Callable[[Connection], Any]], Any], ttl_s: float = 2.0) -> None:
        self.read = read  # ServiceContext.read: a connection the database dropped is replaced
        self.ttl_s = ttl_s
        self._cached: tuple[float, list[GaugeMetricFamily]] | None = None
        self._lock = threading.Lock()

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # no describe-time query: the registry calls collect() only at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            if self._cached is None or time.monotonic() - self._cached[0] >= self.ttl_s:
                self._cached = (time.monotonic(), self._read())
            families = self._cached[1]
        yield from families

    def _read(self) -> list[GaugeMetricFamily]:
        up = GaugeMetricFamily("coordinator_database_up", "1 if the last scrape could read the database")
        try:
            g = self.read(gauges.read)
        except Exception:  # noqa: BLE001 - a scrape must answer even when the database does not
            log.warning("metrics: could not read the database", exc_info=True)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        halted = GaugeMetricFamily("coordinator_sink_halted",
                                   "1 while the sink refuses new batches because of lost data", labels=["sink"])
        open_tx = GaugeMetricFamily(
            "coordinator_open_transactions",
            "Transactions that may be open on Kafka (unresolved leases), by sink and lease state",
            labels=["sink", "state"],
        )
        oldest = GaugeMetricFamily(
            "coordinator_oldest_open_transaction_age_seconds",
            "Age of the sink's oldest unresolved lease (0 when none), by the database's clock",
            labels=["sink"],
        )
        cps = GaugeMetricFamily(
            "coordinator_checkpoints",
            "Checkpoints now in flight or needing attention, by state (OPEN, COMMITTING, LOST)",
            labels=["sink", "state"],
        )
        for sink in sorted(g.halted):  # every state of every sink, zeros included, so series do not vanish
            halted.add_metric([sink], 1 if g.halted[sink] else 0)
            for state in OPEN_STATES:
                open_tx.add_metric([sink, state], g.open_transactions.get((sink, state), 0))
            oldest.add_metric([sink], max(0.0, g.oldest_open_s.get(sink, 0.0)))
            for state in CHECKPOINT_STATES:
                cps.add_metric([sink, state], g.checkpoints.get((sink, state), 0))
        return [up, halted, open_tx, oldest, cps]


def render(extra: CollectorRegistry | None = None) -> tuple[bytes, str]:
    """The exposition text (this process's metrics, then `extra`'s) and its content type."""
    body = generate_latest(REGISTRY)
    if extra is not None:
        body += generate_latest(extra)
    return body, CONTENT_TYPE_LATEST


def database_registry(read: Callable[[Callable[[Connection], Any]], Any]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(read))
    return registry
