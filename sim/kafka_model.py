"""An in-memory model of Kafka's transaction semantics (DESIGN.md §4) on a simulated clock.

What it models, per transactional id: the producer id, epoch, transaction state (Kafka's names:
Empty, Ongoing, PrepareCommit, CompleteCommit, PrepareAbort, CompleteAbort), the partitions the
transaction wrote and its start time; per partition: a log of data records and control markers.

The broker rules (transaction version 1, which is what the coordinator speaks, EndTxn <= v4):
- InitProducerId: first use assigns a new producer id at epoch 0. Otherwise the epoch is bumped;
  an Ongoing transaction is first aborted with a fencing epoch bump (abort markers), and the
  client's retry (after CONCURRENT_TRANSACTIONS) bumps again, so fencing an open transaction
  moves the epoch by 2 and an idle id by 1 (Kafka's TransactionCoordinator.handleInitProducerId).
- Produce: a wrong producer id -> INVALID_PRODUCER_ID_MAPPING, another epoch -> PRODUCER_FENCED;
  the first produce of a transaction starts it (AddPartitionsToTxn: state Ongoing, start time).
- EndTxn: unknown id or other producer id -> INVALID_PRODUCER_ID_MAPPING; other epoch ->
  PRODUCER_FENCED; Ongoing -> markers written, CompleteCommit / CompleteAbort; a commit retried on
  CompleteCommit (same epoch) -> success, likewise abort on CompleteAbort; commit after abort,
  abort after commit, anything on Empty -> INVALID_TXN_STATE.
- Timeout: an Ongoing transaction older than its timeout is aborted by the broker with an epoch
  bump (`expire()`, to be called whenever the clock moves; every operation calls it first), so a
  later resume-commit with the old epoch is PRODUCER_FENCED and its data is gone.
- read_committed: a consumer reads up to the last stable offset (the first offset of the oldest
  open transaction of the partition) and drops the records of aborted transactions.
- KIP-664 ListTransactions / DescribeTransactions: the open transactions under a prefix.

EndTxn and the marker writes complete synchronously here (Prepare* are transient states the model
passes through atomically); CONCURRENT_TRANSACTIONS therefore never reaches a caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from coordinator.kafka.control_plane import (
    BrokerCheck,
    CallOutcome,
    ControlPlaneError,
    FirstOffset,
    KafkaTarget,
    OpenTransaction,
    PartitionStability,
    PreparedTransaction,
    TransactionOutcome,
    call_by_call,
    combine_outcomes,
)
from coordinator.service.clock import ManualClock

EMPTY = "Empty"
ONGOING = "Ongoing"
PREPARE_COMMIT = "PrepareCommit"
COMPLETE_COMMIT = "CompleteCommit"
PREPARE_ABORT = "PrepareAbort"
COMPLETE_ABORT = "CompleteAbort"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class KafkaError(Exception):
    """A broker refusal, with Kafka's error name in snake case (as coordinator/kafka/wire/)."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code.upper()}: {message}" if message else code.upper())
        self.code = code


@dataclass
class TxnMeta:
    transactional_id: str
    producer_id: int
    epoch: int
    timeout_ms: int
    state: str = EMPTY
    start_ms: int | None = None
    partitions: list[tuple[str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class LogEntry:
    offset: int
    producer_id: int
    epoch: int
    value: str | None = None  # data record
    marker: str | None = None  # "COMMIT" / "ABORT" control record


@dataclass(frozen=True)
class OpenTxn:
    transactional_id: str
    producer_id: int
    producer_epoch: int
    state: str
    start_ms: int
    timeout_ms: int
    partitions: tuple[tuple[str, int], ...]


class KafkaModel:
    def __init__(self, clock: ManualClock, *, max_timeout_ms: int = 900_000, first_producer_id: int = 1000) -> None:
        self.clock = clock
        self.max_timeout_ms = max_timeout_ms
        self.txns: dict[str, TxnMeta] = {}
        self.logs: dict[tuple[str, int], list[LogEntry]] = {}
        self._next_pid = first_producer_id
        self.history: list[str] = []  # what the broker did, for traces

    # --- time ---------------------------------------------------------------------------------

    def now_ms(self) -> int:
        return int((self.clock.now() - _EPOCH).total_seconds() * 1000)

    def expire(self) -> list[str]:
        """Abort every Ongoing transaction past its timeout, bumping its epoch (the broker's
        transactional-id expiration task). Returns the ids it aborted."""
        now = self.now_ms()
        done = []
        for meta in self.txns.values():
            if meta.state == ONGOING and meta.start_ms is not None and now >= meta.start_ms + meta.timeout_ms:
                meta.epoch += 1  # the broker fences the producer before it aborts
                self._complete(meta, commit=False)
                self.history.append(f"timeout-abort {meta.transactional_id} -> epoch {meta.epoch}")
                done.append(meta.transactional_id)
        return done

    # --- the transaction coordinator ----------------------------------------------------------

    def init_producer_id(self, transactional_id: str, timeout_ms: int) -> tuple[int, int]:
        self.expire()
        if timeout_ms > self.max_timeout_ms:
            raise KafkaError("invalid_transaction_timeout", f"{timeout_ms} > transaction.max.timeout.ms")
        meta = self.txns.get(transactional_id)
        if meta is None:
            meta = TxnMeta(transactional_id, self._next_pid, 0, timeout_ms)
            self._next_pid += 1
            self.txns[transactional_id] = meta
            self.history.append(f"init {transactional_id} -> pid {meta.producer_id} epoch 0")
            return meta.producer_id, meta.epoch
        if meta.state == ONGOING:
            meta.epoch += 1  # fence, abort (CONCURRENT_TRANSACTIONS to the client, which retries)
            self._complete(meta, commit=False)
        meta.epoch += 1
        meta.timeout_ms = timeout_ms
        self.history.append(f"init {transactional_id} -> pid {meta.producer_id} epoch {meta.epoch}")
        return meta.producer_id, meta.epoch

    def _fence_check(self, transactional_id: str, producer_id: int, epoch: int) -> TxnMeta:
        meta = self.txns.get(transactional_id)
        if meta is None or meta.producer_id != producer_id:
            raise KafkaError("invalid_producer_id_mapping", f"{transactional_id} pid {producer_id}")
        if epoch != meta.epoch:
            raise KafkaError("producer_fenced", f"{transactional_id} epoch {epoch} != {meta.epoch}")
        return meta

    def produce(self, transactional_id: str, producer_id: int, epoch: int, topic: str, partition: int, value: str) -> int:
        self.expire()
        meta = self._fence_check(transactional_id, producer_id, epoch)
        if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
            raise KafkaError("concurrent_transactions")
        if meta.state != ONGOING:  # AddPartitionsToTxn of the first record starts the transaction
            meta.state = ONGOING
            meta.start_ms = self.now_ms()
            meta.partitions = []
        tp = (topic, partition)
        if tp not in meta.partitions:
            meta.partitions.append(tp)
        log = self.logs.setdefault(tp, [])
        log.append(LogEntry(len(log), producer_id, epoch, value=value))
        return len(log) - 1

    def end_txn(self, transactional_id: str, producer_id: int, epoch: int, commit: bool) -> None:
        self.expire()
        meta = self._fence_check(transactional_id, producer_id, epoch)
        if meta.state == ONGOING:
            self._complete(meta, commit=commit)
            self.history.append(f"end {transactional_id} {'commit' if commit else 'abort'} epoch {epoch}")
            return
        if meta.state == COMPLETE_COMMIT and commit:
            return  # a retry of the completed commit: NONE
        if meta.state == COMPLETE_ABORT and not commit:
            return
        raise KafkaError("invalid_txn_state", f"{transactional_id} is {meta.state}")

    def _complete(self, meta: TxnMeta, *, commit: bool) -> None:
        meta.state = PREPARE_COMMIT if commit else PREPARE_ABORT
        for tp in meta.partitions:
            log = self.logs.setdefault(tp, [])
            log.append(LogEntry(len(log), meta.producer_id, meta.epoch, marker="COMMIT" if commit else "ABORT"))
        meta.state = COMPLETE_COMMIT if commit else COMPLETE_ABORT

    # --- observations -------------------------------------------------------------------------

    def list_open(self, prefix: str = "") -> list[OpenTxn]:
        self.expire()
        return [
            OpenTxn(m.transactional_id, m.producer_id, m.epoch, m.state, m.start_ms or 0, m.timeout_ms,
                    tuple(m.partitions))
            for m in sorted(self.txns.values(), key=lambda m: m.transactional_id)
            if m.transactional_id.startswith(prefix) and m.state in (ONGOING, PREPARE_COMMIT, PREPARE_ABORT)
        ]

    def high_watermark(self, topic: str, partition: int) -> int:
        return len(self.logs.get((topic, partition), []))

    def last_stable_offset(self, topic: str, partition: int) -> tuple[int, int | None]:
        """(LSO, producer id of the blocking transaction or None)."""
        log = self.logs.get((topic, partition), [])
        open_pids = {m.producer_id for m in self.txns.values() if m.state == ONGOING and (topic, partition) in m.partitions}
        first_open: dict[int, int] = {}
        for entry in log:
            if entry.marker is not None:
                first_open.pop(entry.producer_id, None)
            elif entry.producer_id in open_pids and entry.producer_id not in first_open:
                first_open[entry.producer_id] = entry.offset
        if not first_open:
            return len(log), None
        pid, offset = min(first_open.items(), key=lambda kv: kv[1])
        return offset, pid

    def read_committed(self, topic: str) -> list[str]:
        """What a read_committed consumer of every partition of the topic sees, in offset order per
        partition: records below the last stable offset whose transaction committed (every
        transaction with a record below the LSO is decided: its marker follows somewhere in the
        log); records of aborted transactions are dropped."""
        return [entry.value or "" for _, entry in self.read_committed_entries(topic)]

    def read_committed_entries(self, topic: str) -> list[tuple[int, LogEntry]]:
        """`read_committed` with each record's partition and log entry (offset, producer id)."""
        self.expire()
        out: list[tuple[int, LogEntry]] = []
        for (t, p) in sorted(self.logs):
            if t != topic:
                continue
            log = self.logs[(t, p)]
            lso, _ = self.last_stable_offset(t, p)
            fate: dict[int, str] = {}  # offset of a data record -> the marker that ended its transaction
            waiting: dict[int, list[int]] = {}
            for entry in log:
                if entry.marker is None:
                    waiting.setdefault(entry.producer_id, []).append(entry.offset)
                else:
                    for offset in waiting.pop(entry.producer_id, []):
                        fate[offset] = entry.marker
            out.extend((p, entry) for entry in log[:lso]
                       if entry.marker is None and fate.get(entry.offset) == "COMMIT")
        return out

    def outcome_at(self, topic: str, partition: int, offset: int) -> str:
        """What a read_committed consumer that seeks to `offset` learns of the record there:
        "committed" (it is returned), "aborted" (the LSO is past it and it is skipped) or
        "unknown" (not below the LSO yet, or no such record)."""
        self.expire()
        log = self.logs.get((topic, partition), [])
        lso, _ = self.last_stable_offset(topic, partition)
        if offset >= min(lso, len(log)) or log[offset].marker is not None:
            return "unknown"
        visible = {e.offset for p, e in self.read_committed_entries(topic) if p == partition}
        return "committed" if offset in visible else "aborted"

    def topics(self) -> list[str]:
        return sorted({t for t, _ in self.logs})

    def partitions_of(self, topic: str) -> list[int]:
        return sorted(p for t, p in self.logs if t == topic)


# A fault hook: called as hook(stage, op, key) with stage "before" (may raise: the request fails
# before the broker applied it, or delay: advance the clock) and "after" (may raise: the broker
# applied it, the response was lost).
FaultHook = Callable[[str, str, str], None]


class ModelControlPlane:
    """coordinator.kafka.control_plane.KafkaControlPlane on the model: commit = EndTxn(commit) with the
    stored id / producer id / epoch; abort = InitProducerId on the id. Broker refusals are
    non-retriable ControlPlaneErrors with Kafka's error name as code; faults from the hook are
    whatever it raises (the runner raises retriable ControlPlaneErrors or a process crash).

    A cluster in `unreachable` (its bootstrap string) answers nothing: a pass of calls to it costs
    its retry budget of time and ends there (the pass's rule), counted in `busy_ms` for the worker
    running it (sim/virtual_time.py turns it into the time that worker is busy)."""

    name = "model"

    def __init__(self, model: KafkaModel, hook: FaultHook | None = None, *, retry_budget_ms: int = 1_000) -> None:
        self.model = model
        self.hook = hook
        self.retry_budget_ms = retry_budget_ms
        self.unreachable: set[str] = set()
        self.busy_ms = 0
        self.calls: list[tuple[str, str]] = []

    def _run(self, op: str, key: str, fn: Callable[[], object]) -> object:
        self.calls.append((op, key))
        if self.hook is not None:
            self.hook("before", op, key)
        try:
            result = fn()
        except KafkaError as exc:
            raise ControlPlaneError(f"{op} {key}: {exc}", retriable=False, code=exc.code) from exc
        if self.hook is not None:
            self.hook("after", op, key)
        return result

    def _reach(self, target: KafkaTarget, budget_ms: int | None) -> None:
        if target.bootstrap_servers in self.unreachable:
            self.busy_ms += self.retry_budget_ms if budget_ms is None else budget_ms
            raise ControlPlaneError(f"cannot bootstrap from {target.bootstrap_servers}", retriable=True,
                                    code="broker_unreachable")

    def commit_all(self, target: KafkaTarget, txns: Sequence[PreparedTransaction], parallelism: int,
                   budget_ms: int | None = None) -> list[CallOutcome]:
        def one(txn: PreparedTransaction) -> None:
            self._reach(target, budget_ms)
            self.commit(target, txn)

        return call_by_call(one, txns)

    def abort_all(self, target: KafkaTarget, transactional_ids: Sequence[str], parallelism: int,
                  budget_ms: int | None = None) -> list[CallOutcome]:
        def one(tid: str) -> None:
            self._reach(target, budget_ms)
            self.abort(target, tid)

        return call_by_call(one, transactional_ids)

    def commit(self, target: KafkaTarget, txn: PreparedTransaction) -> None:
        self._run("commit", txn.transactional_id,
                  lambda: self.model.end_txn(txn.transactional_id, txn.producer_id, txn.producer_epoch, True))

    def abort(self, target: KafkaTarget, transactional_id: str) -> None:
        self._run("abort", transactional_id,
                  lambda: self.model.init_producer_id(transactional_id, target.transaction_timeout_ms))

    def transaction_outcome(
        self, target: KafkaTarget, txn: PreparedTransaction, first_offsets: Sequence[FirstOffset]
    ) -> TransactionOutcome:
        reads = self._run("read_committed", txn.transactional_id,
                          lambda: [self.model.outcome_at(t, p, o) for t, p, o in first_offsets])
        return combine_outcomes([TransactionOutcome(r) for r in reads])  # type: ignore[attr-defined]

    def list_open_transactions(self, target: KafkaTarget, prefix: str) -> list[OpenTransaction]:
        self._reach(target, None)
        listed = self._run("list", prefix, lambda: self.model.list_open(prefix))
        return [
            OpenTransaction(t.transactional_id, t.producer_id, t.producer_epoch, t.state, t.start_ms, t.timeout_ms,
                            t.partitions)
            for t in listed  # type: ignore[attr-defined]
        ]

    def partition_stability(self, target: KafkaTarget, topics: list[str]) -> list[PartitionStability]:
        out = []
        for topic in topics:
            for p in self.model.partitions_of(topic):
                lso, pid = self.model.last_stable_offset(topic, p)
                meta = next((m for m in self.model.txns.values() if m.producer_id == pid), None)
                out.append(PartitionStability(
                    topic, p, self.model.high_watermark(topic, p), lso, pid, meta.epoch if meta else None,
                    lso if pid is not None else None))
        return out

    def check_broker(self, target: KafkaTarget, prefix: str, known_ids: set[str]) -> list[BrokerCheck]:
        ok = target.transaction_timeout_ms <= self.model.max_timeout_ms
        return [BrokerCheck("transaction_timeout", ok, f"model broker max {self.model.max_timeout_ms} ms")]

    def close(self) -> None:
        pass
