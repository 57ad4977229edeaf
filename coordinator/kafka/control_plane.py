"""The one small interface through which the coordinator acts on Kafka (DESIGN.md §3 step 5, §4).

`commit_all` finishes pre-committed transactions from another process by resume (EndTxn with the
stored transactional id, producer id and epoch); `abort_all` ends whatever transaction each id may
hold (initialising a producer on it fences and aborts it). Both take a batch's transactions at
once (a *pass*) and answer each one's `CallOutcome` in order; a pass keeps one rule (`Reach`):
once a call got no answer from the broker and no call got one, the calls not started yet are not
made (`NOT_TRIED`, retriable: their transactions stay pending for the next pass), so an
unreachable broker costs one retry budget, not one per transaction. `transaction_outcome` reads
the partition log as a read_committed consumer at the transaction's first offsets, so that a
refused commit is declared lost only when the log shows its records were dropped (DESIGN.md §3
Revisions). The real implementation on Kafka's wire protocol plugs in here (kafka/wire/); a
KIP-939 (prepared transactions) variant would be another one.

`RecordingControlPlane` is the explicit "no Kafka control plane" mode: it touches no broker and
only records what it was asked to do. It exists for tests and must never run in production;
`coordinator.kafka.build_control_plane` logs that loudly when it is chosen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

from ..protocol.rules import commit_refusal_is_final


@dataclass(frozen=True)
class KafkaTarget:
    """What the control plane needs to know of a sink to reach its transactions."""

    sink_name: str
    bootstrap_servers: str
    transaction_timeout_ms: int


@dataclass(frozen=True)
class PreparedTransaction:
    transactional_id: str
    producer_id: int
    producer_epoch: int


# The codes of a call the broker never answered (unreachable, every request timed out), whatever
# the control plane; the wire plane names a broker's own REQUEST_TIMED_OUT or NETWORK_EXCEPTION
# answer the same, and a pass treats those alike (kafka_passes: a retry later, nothing lost).
NO_ANSWER_CODES = frozenset({"broker_unreachable", "network_exception", "request_timed_out"})


class ControlPlaneError(Exception):
    """`retriable=True`: worth repeating at once (broker unreachable, coordinator moving).
    `retriable=False`: repeating at once will not help. Whether a refused commit can never pass
    is `transaction_gone` (Kafka's code in rules.TRANSACTION_GONE_CODES), not `retriable`: an
    authorization failure or UNKNOWN_SERVER_ERROR is not retriable at once, yet the transaction
    may still commit later."""

    def __init__(self, message: str, *, retriable: bool, code: str = "kafka_error") -> None:
        super().__init__(message)
        self.retriable = retriable
        self.code = code

    @property
    def transaction_gone(self) -> bool:
        return commit_refusal_is_final(self.code)

    @property
    def unanswered(self) -> bool:
        """No answer came from the broker (unreachable, or every request timed out)."""
        return self.code in NO_ANSWER_CODES


NOT_TRIED = "not_tried"  # the code of a call not made: the broker answered none in its pass


@dataclass(frozen=True)
class CallOutcome:
    """One transaction's outcome in a pass: None if the call succeeded, and how long the call took
    from its first try to that outcome (0 for a call not tried)."""

    error: ControlPlaneError | None
    seconds: float = 0.0


class Reach:
    """Whether the broker has answered any call of one pass (`note` each call's outcome as soon as
    it is known); `give_up` says what a call not started yet gets instead, once the pass should stop
    starting calls (None: go on). An unreachable broker costs each call its whole retry budget: 4,096
    winners, 16 at a time, would hold a commit call or the recovery loop for 34 minutes. A success
    or a refusal is an answer; after one, every call is made, so trouble at one transaction
    coordinator never holds the others back toward their timeout."""

    def __init__(self) -> None:
        self.reached = False

    def note(self, error: ControlPlaneError | None) -> ControlPlaneError | None:
        if error is None or not error.unanswered:
            self.reached = True  # a success or a refusal is an answer
        return error

    def give_up(self, error: ControlPlaneError | None) -> ControlPlaneError | None:
        if error is None or not error.unanswered or self.reached:
            return None
        return ControlPlaneError(f"not tried in this pass: the broker answered none of its calls ({error.code})",
                                 retriable=True, code=NOT_TRIED)


class TransactionOutcome(StrEnum):
    """What the partition log says of a transaction, read at its first offsets."""

    COMMITTED = "committed"  # read_committed returns the record at a first offset: it committed
    ABORTED = "aborted"  # the log is stable past a first offset and read_committed skips that record
    UNKNOWN = "unknown"  # no first offsets, still open (offset >= LSO), gone from the log, or unreadable


# one of the transaction's partitions and the offset of its first record there
FirstOffset = tuple[str, int, int]


def combine_outcomes(outcomes: Sequence[TransactionOutcome]) -> TransactionOutcome:
    """A transaction commits or aborts on all its partitions at once, so one conclusive read
    decides. Reads that disagree (a first offset that was not the transaction's) are UNKNOWN."""
    found = set(outcomes) - {TransactionOutcome.UNKNOWN}
    return found.pop() if len(found) == 1 else TransactionOutcome.UNKNOWN


@dataclass(frozen=True)
class OpenTransaction:
    """A transaction the broker reports as not completed (KIP-664 ListTransactions +
    DescribeTransactions)."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    state: str  # Kafka's name: Ongoing, PrepareCommit, PrepareAbort, ...
    started_at_ms: int | None  # broker time the transaction started, epoch ms
    timeout_ms: int | None
    partitions: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class PartitionStability:
    """One output partition as a read_committed consumer sees it: the last stable offset stops at
    the first offset of the oldest open transaction (KIP-664 DescribeProducers names it)."""

    topic: str
    partition: int
    high_watermark: int
    last_stable_offset: int
    blocking_producer_id: int | None = None
    blocking_producer_epoch: int | None = None
    blocking_txn_start_offset: int | None = None


@dataclass(frozen=True)
class BrokerCheck:
    """One verdict of a broker check, in plain words, with the fix when it failed."""

    name: str
    ok: bool
    verdict: str
    fix: str | None = None
    verified: bool = True  # False: the broker cannot answer this question (e.g. lacks the API)


class KafkaControlPlane(Protocol):
    name: str

    def commit_all(self, target: KafkaTarget, txns: Sequence[PreparedTransaction], parallelism: int,
                   budget_ms: int | None = None) -> list[CallOutcome]:
        """Commit each transaction by resume (EndTxn), at most `parallelism` calls at once,
        retrying transient failures for `budget_ms` (None: the plane's retry budget); each one's
        outcome in order."""
        ...

    def abort_all(self, target: KafkaTarget, transactional_ids: Sequence[str], parallelism: int,
                  budget_ms: int | None = None) -> list[CallOutcome]:
        """End whatever transaction each id may hold (InitProducerId fences it); outcomes in order."""
        ...

    def transaction_outcome(
        self, target: KafkaTarget, txn: PreparedTransaction, first_offsets: Sequence[FirstOffset]
    ) -> TransactionOutcome:
        """Read each (topic, partition, offset) as a read_committed consumer: COMMITTED if the
        record there is returned, ABORTED if the last stable offset is past it and it is skipped,
        UNKNOWN otherwise (and always with no first offsets). Never raises for an unreadable log:
        that is UNKNOWN too."""
        ...

    def list_open_transactions(self, target: KafkaTarget, prefix: str) -> list[OpenTransaction]:
        """Every transaction not completed on the broker whose transactional id starts with prefix."""
        ...

    def partition_stability(self, target: KafkaTarget, topics: list[str]) -> list[PartitionStability]:
        """High watermark and last stable offset of every partition of these topics."""
        ...

    def check_broker(self, target: KafkaTarget, prefix: str, known_ids: set[str]) -> list[BrokerCheck]:
        """Reachability, advertised listeners, transaction support, transaction.max.timeout.ms
        against target.transaction_timeout_ms, and transactional ids under prefix that are not
        in known_ids (another producer using the prefix)."""
        ...

    def close(self) -> None: ...


def raise_for(outcome: CallOutcome) -> None:
    """A single call's outcome as a single call answers it: nothing, or its error raised."""
    if outcome.error is not None:
        raise outcome.error


class RecordingControlPlane:
    """Test-only: records commits and aborts instead of sending them. `fail_next` makes the next
    calls raise, so tests can exercise the coordinator's handling of Kafka failures. Without
    `keep_history` (a server in the "none" mode, a benchmark) it forgets each commit and abort
    once done: nobody reads that process's lists, and they grew by P entries per batch."""

    name = "none"

    def __init__(self, *, keep_history: bool = True) -> None:
        self.keep_history = keep_history
        self.commits: list[tuple[str, PreparedTransaction]] = []
        self.aborts: list[tuple[str, str]] = []
        self.open_transactions: list[OpenTransaction] = []
        self.partitions: list[PartitionStability] = []
        self.broker_checks: list[BrokerCheck] | None = None  # what check_broker answers, if set
        self.outcomes: dict[str, TransactionOutcome] = {}  # what transaction_outcome answers per id
        self.outcome_reads: list[tuple[str, tuple[FirstOffset, ...]]] = []
        self._failures: list[ControlPlaneError] = []
        self._lock = threading.Lock()

    def fail_next(self, error: ControlPlaneError, times: int = 1) -> None:
        with self._lock:
            self._failures.extend([error] * times)

    def clear_failures(self) -> None:
        """Drop the failures fail_next queued and no call has raised yet (the broker is back)."""
        with self._lock:
            self._failures.clear()

    def _maybe_fail(self) -> None:
        with self._lock:
            if self._failures:
                raise self._failures.pop(0)

    def commit(self, target: KafkaTarget, txn: PreparedTransaction) -> None:
        self._maybe_fail()
        with self._lock:
            if self.keep_history:
                self.commits.append((target.sink_name, txn))
            self._end(txn.transactional_id)

    def abort(self, target: KafkaTarget, transactional_id: str) -> None:
        self._maybe_fail()
        with self._lock:
            if self.keep_history:
                self.aborts.append((target.sink_name, transactional_id))
            self._end(transactional_id)

    def commit_all(self, target: KafkaTarget, txns: Sequence[PreparedTransaction], parallelism: int,
                   budget_ms: int | None = None) -> list[CallOutcome]:
        return call_by_call(lambda txn: self.commit(target, txn), txns)

    def abort_all(self, target: KafkaTarget, transactional_ids: Sequence[str], parallelism: int,
                  budget_ms: int | None = None) -> list[CallOutcome]:
        return call_by_call(lambda tid: self.abort(target, tid), transactional_ids)

    def _end(self, transactional_id: str) -> None:
        self.open_transactions = [t for t in self.open_transactions if t.transactional_id != transactional_id]

    # Observations are whatever a test put here (a broker stand-in with settable answers).
    def transaction_outcome(
        self, target: KafkaTarget, txn: PreparedTransaction, first_offsets: Sequence[FirstOffset]
    ) -> TransactionOutcome:
        with self._lock:
            if self.keep_history:
                self.outcome_reads.append((txn.transactional_id, tuple(first_offsets)))
            return self.outcomes.get(txn.transactional_id, TransactionOutcome.UNKNOWN)

    def list_open_transactions(self, target: KafkaTarget, prefix: str) -> list[OpenTransaction]:
        self._maybe_fail()
        with self._lock:
            return [t for t in self.open_transactions if t.transactional_id.startswith(prefix)]

    def partition_stability(self, target: KafkaTarget, topics: list[str]) -> list[PartitionStability]:
        self._maybe_fail()
        with self._lock:
            return [p for p in self.partitions if p.topic in topics]

    def check_broker(self, target: KafkaTarget, prefix: str, known_ids: set[str]) -> list[BrokerCheck]:
        self._maybe_fail()
        with self._lock:
            if self.broker_checks is not None:
                return list(self.broker_checks)
        return [BrokerCheck("control_plane", True, "record-only test control plane: no broker was checked")]

    def close(self) -> None:
        pass



Item = TypeVar("Item")


def call_by_call(call: Callable[[Item], None], items: Sequence[Item]) -> list[CallOutcome]:
    """A pass made of single calls, one after the other, keeping the pass's rule (`Reach`): a plane
    whose calls cost nothing (the recording one, the simulation's model) needs no concurrency."""
    reach = Reach()
    out: list[CallOutcome] = []
    for item in items:
        if out and (instead := reach.give_up(out[-1].error)) is not None:
            out.extend(CallOutcome(instead) for _ in items[len(out):])
            break
        started = time.monotonic()
        try:
            call(item)
        except ControlPlaneError as exc:
            out.append(CallOutcome(reach.note(exc), time.monotonic() - started))
        else:
            out.append(CallOutcome(reach.note(None), time.monotonic() - started))
    return out
