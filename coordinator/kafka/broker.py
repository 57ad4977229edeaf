"""What the coordinator makes of its observations of the broker (DESIGN.md §3 step 6, issue 3:
stuck-consumer detection, the lingering-transaction sweep, broker checks).

The first half is I/O free and unit tested (tests/test_broker.py):

`stuck_partitions(previous, current, elapsed_s)`
    A partition is stuck when its last stable offset (LSO) stays below its high watermark (HW)
    and does not move between two observations: an open transaction holds every
    `read_committed` consumer of it at the LSO. A healthy batch also holds the LSO while its
    transaction is open, so "stuck" means "for longer than `min_stall_s`".
`name_blocking_transactions(stuck, leases, open_transactions)`
    The producer DescribeProducers named as holding each stuck partition, mapped to the
    coordinator's lease (and so to its transactional id, checkpoint and attempt), or to a
    transactional id from ListTransactions the coordinator does not know.
(Which open transactions are lingering is decided in coordinator/protocol/recovery_rules.py.)

The second half is the thin glue the HTTP API uses for on-demand checks: `check_sink_broker`
(`check_broker` with the sink's pool ids as the known ids) and `observe_partitions`
(`partition_stability` compared with the previous observation kept in-process per sink by a
`PartitionWatch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import select

from ..service import metrics
from .control_plane import (
    BrokerCheck,
    ControlPlaneError,
    KafkaControlPlane,
    KafkaTarget,
    OpenTransaction,
    PartitionStability,
)
from ..protocol import errors as e
from ..protocol import recovery_rules, rules
from ..protocol.model import Lease, Sink
from ..protocol.states import UNRESOLVED_LEASE_STATES
from ..store import repo
from ..store.tables import leases, transactional_ids

if TYPE_CHECKING:
    from ..service import Coordinator

log = logging.getLogger(__name__)

# states in which the broker itself is finishing the transaction: aborting them is pointless
# (InitProducerId answers CONCURRENT_TRANSACTIONS until the broker is done)


# --- interpretation (no I/O) ---------------------------------------------------------------------


@dataclass(frozen=True)
class StuckPartition:
    topic: str
    partition: int
    high_watermark: int
    last_stable_offset: int
    stalled_for_s: float  # at least this long the LSO has not moved while below the HW
    blocking_producer_id: int | None = None
    blocking_producer_epoch: int | None = None
    blocking_txn_start_offset: int | None = None

    @property
    def lag(self) -> int:
        """Records a read_committed consumer cannot read yet."""
        return self.high_watermark - self.last_stable_offset


@dataclass(frozen=True)
class BlockingTransaction:
    """Who holds a stuck partition, in the coordinator's terms."""

    topic: str
    partition: int
    producer_id: int | None
    producer_epoch: int | None
    transactional_id: str | None  # None: the broker did not say, and no lease or listing names it
    lease_id: int | None  # the coordinator's lease of this transaction, None if it has none
    lease_state: str | None
    known: bool  # the coordinator's own transaction (a lease names it)
    explanation: str


def stuck_partitions(
    previous: Iterable[PartitionStability],
    current: Iterable[PartitionStability],
    elapsed_s: float,
    *,
    min_stall_s: float = 0.0,
) -> list[StuckPartition]:
    """Partitions whose LSO was below the HW in both observations and did not advance between
    them (taken `elapsed_s` apart), if that is at least `min_stall_s`. A partition seen only once,
    or whose LSO moved, or that caught up (LSO == HW), is not stuck. The blocking producer is the
    one the current observation names."""
    if elapsed_s <= 0 or elapsed_s < min_stall_s:
        return []
    before = {(p.topic, p.partition): p for p in previous}
    stuck = []
    for now in current:
        old = before.get((now.topic, now.partition))
        if old is None:
            continue
        if not (now.last_stable_offset < now.high_watermark and old.last_stable_offset < old.high_watermark):
            continue
        if now.last_stable_offset > old.last_stable_offset:
            continue  # advancing
        if now.last_stable_offset < old.last_stable_offset:
            continue  # went back: the log was truncated or the partition recreated, not the same stall
        stuck.append(StuckPartition(
            now.topic, now.partition, now.high_watermark, now.last_stable_offset, elapsed_s,
            now.blocking_producer_id, now.blocking_producer_epoch, now.blocking_txn_start_offset,
        ))
    return sorted(stuck, key=lambda s: (s.topic, s.partition))


def name_blocking_transactions(
    stuck: Iterable[StuckPartition],
    leases_: Iterable[Lease],
    open_transactions: Iterable[OpenTransaction] = (),
) -> list[BlockingTransaction]:
    """Map each stuck partition's blocking producer to the coordinator's lease: an exact (producer
    id, epoch) match first, else an unresolved lease of that producer id (a pooled transactional
    id keeps its producer id across epochs), else the newest lease of it. Without a lease, a
    broker listing (ListTransactions / DescribeTransactions) may still name the transactional id."""
    by_pid: dict[int, list[Lease]] = {}
    for lease in leases_:
        if lease.producer_id is not None:
            by_pid.setdefault(lease.producer_id, []).append(lease)
    listed = {t.producer_id: t for t in open_transactions}
    unresolved = {s.value for s in UNRESOLVED_LEASE_STATES}
    named = []
    for s in stuck:
        pid, epoch = s.blocking_producer_id, s.blocking_producer_epoch
        where = f"{s.topic}-{s.partition} (LSO {s.last_stable_offset}, HW {s.high_watermark})"
        if pid is None:
            named.append(BlockingTransaction(
                s.topic, s.partition, None, None, None, None, None, False,
                f"{where} is held by an open transaction the broker did not name (DescribeProducers unsupported, "
                "refused or not yet run); list the sink's open transactions to find it",
            ))
            continue
        candidates = sorted(by_pid.get(pid, []), key=lambda x: x.id)
        exact = [x for x in candidates if x.producer_epoch == epoch]
        open_ones = [x for x in candidates if x.state.value in unresolved]
        lease = (exact or open_ones or candidates or [None])[-1]
        if lease is not None:
            named.append(BlockingTransaction(
                s.topic, s.partition, pid, epoch, lease.transactional_id, lease.id, lease.state.value, True,
                f"{where} is held by the coordinator's transaction {lease.transactional_id} (lease {lease.id}, "
                f"{lease.state.value}, producer id {pid} epoch {epoch})",
            ))
            continue
        txn = listed.get(pid)
        tid = txn.transactional_id if txn is not None else None
        who = f"transactional id {tid}" if tid else "a producer"
        named.append(BlockingTransaction(
            s.topic, s.partition, pid, epoch, tid, None, None, False,
            f"{where} is held by {who} (producer id {pid} epoch {epoch}) the coordinator has no lease for",
        ))
    return named


@dataclass
class _Seen:
    observation: PartitionStability
    since: float  # monotonic time the LSO was first seen at this value


@dataclass
class PartitionWatch:
    """In-process memory of the last observation per sink and partition, so that a stateless
    caller (an HTTP request) can tell a stalled LSO from a moving one. Per partition it keeps the
    first observation at the current LSO, so the stall is measured from when the LSO stopped."""

    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, dict[tuple[str, int], _Seen]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, sink: str, current: Sequence[PartitionStability], *, min_stall_s: float = 0.0) -> list[StuckPartition]:
        now = self.clock()
        stuck: list[StuckPartition] = []
        with self._lock:
            seen = self._seen.setdefault(sink, {})
            fresh: dict[tuple[str, int], _Seen] = {}
            for p in current:
                key = (p.topic, p.partition)
                old = seen.get(key)
                if old is not None:
                    stuck += stuck_partitions([old.observation], [p], now - old.since, min_stall_s=min_stall_s)
                if old is not None and old.observation.last_stable_offset == p.last_stable_offset \
                        and old.observation.last_stable_offset < old.observation.high_watermark:
                    fresh[key] = old  # same stall: keep measuring from its start
                else:
                    fresh[key] = _Seen(p, now)
            self._seen[sink] = fresh
        return sorted(stuck, key=lambda s: (s.topic, s.partition))

    def forget(self, sink: str) -> None:
        with self._lock:
            self._seen.pop(sink, None)


# --- on-demand checks through the coordinator ------------------------------------------------------


@dataclass(frozen=True)
class PartitionReport:
    partitions: list[PartitionStability]
    stuck: list[StuckPartition]
    blocking: list[BlockingTransaction]
    notes: list[str]


def _plane_and_target(coordinator: Coordinator, name: str) -> tuple[KafkaControlPlane, KafkaTarget, Sink]:
    sink = coordinator.get_sink(name)  # 404 for an unknown sink, before anything else
    if coordinator.control_plane is None:
        raise e.Unavailable(
            e.NO_CONTROL_PLANE,
            "the coordinator has no Kafka control plane configured (COORDINATOR_KAFKA_CONTROL_PLANE), so it cannot "
            "observe the broker",
        )
    return coordinator.control_plane, KafkaTarget(sink.name, sink.bootstrap_servers, sink.transaction_timeout_ms), sink


def known_transactional_ids(coordinator: Coordinator, sink_id: int) -> set[str]:
    """Every transactional id of the sink's pool: the ids the coordinator created under its prefix."""
    with coordinator.engine.connect() as conn:
        rows = conn.execute(select(transactional_ids.c.transactional_id).where(transactional_ids.c.sink_id == sink_id))
        return set(rows.scalars())


def check_sink_broker(coordinator: Coordinator, name: str) -> list[BrokerCheck]:
    """`check_broker` for a registered sink: its bootstrap servers, transaction timeout and id
    prefix ("<prefix>-", as the pool names ids), with the sink's pool ids as the ids the
    coordinator knows. 503 without a control plane."""
    plane, target, sink = _plane_and_target(coordinator, name)
    known = known_transactional_ids(coordinator, sink.id)
    # pool ids are "<stem><ordinal>" (rules.transactional_id_for): only ids under the stem can collide
    return plane.check_broker(target, rules.transactional_id_stem(sink.transactional_id_prefix), known)


def lingering_transactions(coordinator: Coordinator, name: str) -> list[OpenTransaction]:
    """The open transactions under the sink's prefix that no unresolved lease explains, read only
    (the dashboard shows them; the recovery loop's `Coordinator.sweep_lingering` aborts them)."""
    plane, target, sink = _plane_and_target(coordinator, name)
    listed = plane.list_open_transactions(target, rules.transactional_id_stem(sink.transactional_id_prefix))
    return recovery_rules.lingering(listed, coordinator.possibly_open_transactions(name)) if listed else []


def observe_partitions(coordinator: Coordinator, name: str, watch: PartitionWatch, *, min_stall_s: float) -> PartitionReport:
    """High watermark and last stable offset of every partition of the sink's topics, which of them
    are stuck (compared with the previous observation this process made), and who holds them.
    A broker failure is a 503 naming it."""
    plane, target, sink = _plane_and_target(coordinator, name)
    topics = list(sink.topics)
    try:
        current = plane.partition_stability(target, topics)
    except ControlPlaneError as exc:
        raise e.Unavailable("kafka_unavailable", f"could not observe the sink's partitions: {exc}", code=exc.code) from exc
    metrics.partitions_observed(name, current)
    stuck = watch.observe(name, current, min_stall_s=min_stall_s)
    notes = []
    if not topics:
        notes.append("the sink was registered without topics: nothing to observe")
    if stuck:
        pids = sorted({s.blocking_producer_id for s in stuck if s.blocking_producer_id is not None})
        with coordinator.engine.connect() as conn:
            related = repo.leases_where(conn, leases.c.sink_id == sink.id, leases.c.producer_id.in_(pids)) if pids else []
        blocking = name_blocking_transactions(stuck, related)
        if any(s.blocking_producer_id is None for s in stuck):
            notes.append("the broker did not name the producer holding some partitions (DescribeProducers, KIP-664, "
                         "Kafka >= 3.0, unsupported or refused)")
    else:
        blocking = []
    return PartitionReport(current, stuck, blocking, notes)


def record_lso_lag(coordinator: Coordinator, name: str) -> None:
    """Observe the sink's partitions and set their last-stable-offset lag gauges (the recovery
    loop calls this every iteration). Best effort: a failure is logged, never raised."""
    try:
        plane, target, sink = _plane_and_target(coordinator, name)
        metrics.partitions_observed(name, plane.partition_stability(target, list(sink.topics)))
    except Exception as exc:  # noqa: BLE001 - the gauge is an observation, not a step of recovery
        log.debug("could not observe the partitions of sink %s for the lag gauge: %s", name, exc)
