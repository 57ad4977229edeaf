"""What the coordinator makes of its observations of the broker (DESIGN.md §3 step 6, issue 3:
stuck-consumer detection, the lingering-transaction sweep, broker checks).

All of it is I/O free and unit tested (tests/kafka/test_broker.py):

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
`PartitionWatch`
    The previous observation per sink and partition, kept in-process, so that a stateless caller
    can tell a stalled last stable offset from a moving one.

The glue that runs these against a registered sink through the coordinator (`check_sink_broker`,
`observe_partitions`, `lingering_transactions`, `record_lso_lag`) is in
coordinator/service/broker_checks.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..protocol.model import Lease
from ..protocol.states import UNRESOLVED_LEASE_STATES
from .control_plane import OpenTransaction, PartitionStability

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
    id keeps its producer id across epochs), else the newest lease of it; else, through the
    broker's listing (ListTransactions / DescribeTransactions: producer id -> transactional id),
    the unresolved lease holding that id (a try's producer id is known to the coordinator only once
    its record comes with the commit). Without a lease, the listing may still name the id."""
    by_pid: dict[int, list[Lease]] = {}
    by_tid: dict[str, Lease] = {}
    unresolved = {s.value for s in UNRESOLVED_LEASE_STATES}
    for lease in leases_:
        if lease.producer_id is not None:
            by_pid.setdefault(lease.producer_id, []).append(lease)
        if lease.state.value in unresolved:
            by_tid[lease.transactional_id] = lease
    listed = {t.producer_id: t for t in open_transactions}
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
        if lease is None and pid in listed:
            lease = by_tid.get(listed[pid].transactional_id)
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
