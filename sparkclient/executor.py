"""Executor side: one Spark task attempt writes one partition of a batch in one Kafka transaction.

Per task attempt (DESIGN §3 with its Revisions): an empty partition takes no lease and opens no
transaction. Otherwise the partition's first try (stage attempt 0, task attempt 0) uses the lease
begin took for it, and any other try (a retry, a speculative copy, a stage retry) leases its own
id, so no two tries share one. The task refuses to start `init_transactions` on a lease older than
the coordinator's bound (an id freed from a stalled try is reused only after a quarantine longer
than that bound plus the init timeouts), then `init_transactions`, `begin_transaction`, produce
every row, `flush`, check every delivery report (any failure fails the task: a transaction that
lost a record is never committed), read producer id and epoch from librdkafka's statistics
(`eos.producer_id`, `eos.producer_epoch`: the only place it exposes them), check that the
transaction is not already inside the commit margin of its deadline, and release the producer
WITHOUT ending the transaction (not `close()`, which aborts it). The task makes no pre-commit
call: its result carries the pre-commit record (lease, producer id, epoch, counts, first offset
written in a few of its topic-partitions) to the driver, which sends the accepted ones with the
commit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from .client import CoordinatorClient

# The record names the first offset written in the FIRST_OFFSETS_REPORTED lowest topic-partitions
# (topic, then partition) its transaction wrote, not in all: the coordinator keeps as many
# (coordinator/protocol/model.py, FIRST_OFFSETS_KEPT), since one conclusive read of the log tells
# whether a transaction committed. A task that wrote every partition of a 200-partition topic
# would otherwise add 200 to the driver's commit, 40,000 for 200 tasks.
FIRST_OFFSETS_REPORTED = 4

log = logging.getLogger(__name__)

# Provenance headers (option provenance.headers): which sink, batch, attempt and lease (task
# attempt's transaction) wrote a record. A lease id is unique per coordinator database.
HEADER_SINK = "eos-sink"
HEADER_BATCH = "eos-batch-id"
HEADER_ATTEMPT = "eos-attempt"
HEADER_LEASE = "eos-lease-id"

STATS_INTERVAL_MS = 20  # librdkafka statistics: the only place producer id and epoch are reported
STATS_WAIT_S = 30.0
KAFKA_CALL_TIMEOUT_S = 60.0

FaultHook = Callable[..., None]


class DeliveryFailed(RuntimeError):
    """A record of the transaction was not acknowledged; the task fails and Spark retries it."""


class LeaseTooOld(RuntimeError):
    """The lease is older than the coordinator's bound for starting init_transactions (its id may
    already be in quarantine and leased again after it); the task fails, the retry leases anew."""


class DeadlineTooClose(RuntimeError):
    """The transaction is already inside the commit margin of its deadline: the commit gate would
    refuse it, so the task fails and Spark retries it with a fresh transaction."""


@dataclass(frozen=True)
class TaskSpec:
    """What every task of one batch attempt needs (shipped to executors in the task closure)."""

    coordinator_url: str
    coordinator_token: str
    sink: str
    request_timeout_ms: int
    retry_budget_ms: int
    batch_id: int
    attempt: int
    generation: int
    bootstrap_servers: str
    producer_config: dict[str, Any]
    topic: str | None
    columns: tuple[str, ...]
    provenance_headers: bool
    fault_hook: FaultHook | None = field(default=None, compare=False)
    # from begin: partition -> the first try's lease, when the driver received them (its wall clock),
    # and the rules a task keeps (the commit margin, the lease age bound, the producer's timeouts)
    pre_leases: dict[int, dict[str, Any]] = field(default_factory=dict)
    leases_received_at: float = 0.0
    commit_margin_ms: int = 0
    max_lease_init_age_ms: int | None = None
    producer_init_timeout_ms: int = int(KAFKA_CALL_TIMEOUT_S * 1000)
    producer_request_timeout_ms: int | None = None

    def client(self) -> CoordinatorClient:
        """This process's client for the sink (kept across tasks: a reused Python worker keeps its
        connection to the coordinator instead of opening one per task)."""
        key = (self.coordinator_url, self.coordinator_token, self.sink, self.request_timeout_ms, self.retry_budget_ms)
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                client = _CLIENTS[key] = CoordinatorClient(
                    self.coordinator_url, self.coordinator_token, self.sink,
                    timeout_s=self.request_timeout_ms / 1000, retry_budget_s=self.retry_budget_ms / 1000)
            return client


# One coordinator client per process and sink options (see TaskSpec.client); httpx clients are
# thread-safe. A forked child (PySpark forks its workers) starts with none: it must not use its
# parent's connections (dropping them there only closes the child's copies of the sockets).
_CLIENTS: dict[tuple[Any, ...], CoordinatorClient] = {}
_CLIENTS_LOCK = threading.Lock()


def _forget_parent_clients() -> None:
    global _CLIENTS_LOCK
    _CLIENTS_LOCK = threading.Lock()
    _CLIENTS.clear()


os.register_at_fork(after_in_child=_forget_parent_clients)


@dataclass(frozen=True)
class TaskResult:
    """One task attempt's answer; Spark keeps exactly one per partition (the winner)."""

    partition: int
    lease_id: int | None  # None: empty partition, no transaction
    task_attempt_id: int
    records: int = 0
    bytes: int = 0
    write_ms: int = 0
    transactional_id: str | None = None
    producer_id: int | None = None
    producer_epoch: int | None = None
    first_offsets: list[list[Any]] | None = None  # [[topic, partition, first offset written], ...], a few

    def precommit_record(self) -> dict[str, Any]:
        """What the commit carries for this winner."""
        return {"producer_id": self.producer_id, "producer_epoch": self.producer_epoch, "records": self.records,
                "bytes": self.bytes, "write_ms": self.write_ms, "first_offsets": self.first_offsets}


def is_first_try(stage_attempt: int, task_attempt: int) -> bool:
    """Only a partition's first try uses the lease begin took for it (coordinator/protocol/rules.py
    says the same; the client does not import the coordinator)."""
    return stage_attempt == 0 and task_attempt == 0


def lease_age_ms(lease: dict[str, Any], now: float) -> int:
    """The lease's age by its answer (the database's clock) plus the time since it was received."""
    return int(lease.get("age_ms") or 0) + max(0, int((now - lease["received_at"]) * 1000))


def check_lease_young_enough(lease: dict[str, Any], max_age_ms: int | None, now: float) -> None:
    if max_age_ms is not None and lease_age_ms(lease, now) > max_age_ms:
        raise LeaseTooOld(f"lease {lease['lease_id']} ({lease['transactional_id']}) is {lease_age_ms(lease, now)} ms "
                          f"old, above the {max_age_ms} ms bound for starting init_transactions; the task fails and "
                          "its retry leases a fresh id")


def check_deadline_outside_margin(lease: dict[str, Any], margin_ms: int, now: float) -> None:
    left = int(lease["transaction_timeout_ms"]) - lease_age_ms(lease, now)
    if left < margin_ms:
        raise DeadlineTooClose(f"lease {lease['lease_id']}'s transaction has {left} ms left before the broker may "
                               f"abort it, below the commit margin of {margin_ms} ms; the task fails so Spark "
                               "retries it with a fresh transaction")


def write_partition(spec: TaskSpec, partition: int, rows: Iterable[Any]) -> Iterator[TaskResult]:
    """The body of `mapPartitionsWithIndex` on the batch's rows."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    task_attempt_id = ctx.taskAttemptId() if ctx else 0
    attempt_number = ctx.attemptNumber() if ctx else 0
    # PySpark's TaskContext does not tell the stage attempt (the driver redoes a batch whose write job
    # had a stage retried: writer._WriteJobs); use it where a version does
    stage_attempt = getattr(ctx, "stageAttemptNumber", lambda: 0)() if ctx else 0
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        yield TaskResult(partition, None, task_attempt_id)
        return
    hook = _hook(spec, partition, attempt_number)
    pre_lease = spec.pre_leases.get(partition) if is_first_try(stage_attempt, attempt_number) else None
    if pre_lease is not None:
        lease = {**pre_lease, "received_at": spec.leases_received_at}
    else:
        lease = spec.client().lease(spec.batch_id, spec.attempt, spec.generation, partition, task_attempt_id)
        lease["received_at"] = time.time()
    hook("after_lease", lease=lease)
    result = _write_transaction(spec, partition, task_attempt_id, lease, chain([first], rows), hook)
    hook("after_precommit", result=result)
    yield result


def _hook(spec: TaskSpec, partition: int, attempt_number: int) -> Callable[..., None]:
    def call(step: str, **info: Any) -> None:
        if spec.fault_hook is not None:
            spec.fault_hook(step, batch_id=spec.batch_id, partition=partition, task_attempt=attempt_number, **info)
    return call


def producer_socket_timeout_ms(request_timeout_ms: int | None, transaction_timeout_ms: int) -> int:
    """librdkafka refuses a transactional producer whose socket.timeout.ms (default 60 s) is above
    transaction.timeout.ms + 100, so a sink with a shorter transaction timeout lowers it. Lowering
    only shortens how long a stalled request can act, which keeps the id quarantine's bound."""
    return min(request_timeout_ms or 60_000, transaction_timeout_ms + 100)


def _write_transaction(spec: TaskSpec, partition: int, task_attempt_id: int, lease: dict[str, Any],
                       rows: Iterator[Any], hook: Callable[..., None]) -> TaskResult:
    from confluent_kafka import Producer

    stats = _EosStats()
    # no InitProducerId on an old lease: its id may be past its quarantine and leased again
    check_lease_young_enough(lease, spec.max_lease_init_age_ms, time.time())
    timeouts = {"socket.timeout.ms": producer_socket_timeout_ms(spec.producer_request_timeout_ms,
                                                                lease["transaction_timeout_ms"])}

    producer = Producer({
        **spec.producer_config,
        **timeouts,
        "bootstrap.servers": spec.bootstrap_servers,
        "transactional.id": lease["transactional_id"],
        "transaction.timeout.ms": lease["transaction_timeout_ms"],  # the sink's: the commit gate's deadline
        "enable.idempotence": True,
        "acks": "all",
        "statistics.interval.ms": STATS_INTERVAL_MS,
        "stats_cb": stats.on_report,
    })
    try:
        started = time.monotonic()
        producer.init_transactions(spec.producer_init_timeout_ms / 1000)
        producer.begin_transaction()
        stats.transaction_begun()
        records, size, failures = _produce_rows(spec, lease, producer, rows)
        left = producer.flush(KAFKA_CALL_TIMEOUT_S)
        if left or failures["errors"] or failures["delivered"] != records:
            raise DeliveryFailed(
                f"batch {spec.batch_id} partition {partition}: {failures['delivered']} of {records} records "
                f"acknowledged, {left} still queued, errors: {failures['errors'][:5]}; the task fails so that "
                "Spark retries it (this transaction is never committed)")
        write_ms = int((time.monotonic() - started) * 1000)
        producer_id, producer_epoch = _producer_id_and_epoch(producer, stats, spec, partition)
        check_deadline_outside_margin(lease, spec.commit_margin_ms, time.time())
        hook("before_precommit", lease=lease)
    except BaseException:
        # A failed task attempt is never a winner: end its transaction now rather than leave it to
        # the coordinator (close() would abort it too; abort_transaction first bounds the wait).
        try:
            producer.abort_transaction(10)
        except Exception:  # noqa: BLE001 - the failure being raised matters more
            pass
        producer.close()
        raise
    # Pre-committed: the transaction must stay open for the coordinator's resume-commit. Producer.close()
    # in confluent-kafka 2.16 (pinned) ABORTS an ongoing transaction, so the producer is released by dropping
    # the last reference instead (the handle's dealloc destroys librdkafka's instance and its threads
    # without ending the transaction).
    del producer
    first_offsets = [[t, p, o] for (t, p), o in sorted(failures["first_offsets"].items())[:FIRST_OFFSETS_REPORTED]]
    return TaskResult(partition, lease["lease_id"], task_attempt_id, records, size, write_ms, lease["transactional_id"],
                      producer_id, producer_epoch, first_offsets)


def _produce_rows(spec: TaskSpec, lease: dict[str, Any], producer: Any, rows: Iterator[Any]) -> tuple[int, int, dict[str, Any]]:
    cols = spec.columns
    i_value = cols.index("value")
    i_key = cols.index("key") if "key" in cols else None
    i_topic = cols.index("topic") if "topic" in cols else None
    i_partition = cols.index("partition") if "partition" in cols else None
    i_headers = cols.index("headers") if "headers" in cols else None
    provenance = [
        (HEADER_SINK, spec.sink.encode()),
        (HEADER_BATCH, str(spec.batch_id).encode()),
        (HEADER_ATTEMPT, str(spec.attempt).encode()),
        (HEADER_LEASE, str(lease["lease_id"]).encode()),
    ] if spec.provenance_headers else None
    first_offsets: dict[tuple[str, int], int] = {}
    outcome: dict[str, Any] = {"delivered": 0, "errors": [], "first_offsets": first_offsets}

    def on_delivery(err: Any, msg: Any) -> None:
        if err is None:
            outcome["delivered"] += 1
            tp = (msg.topic(), msg.partition())
            offset = msg.offset()
            if offset is not None and offset >= 0 and (tp not in first_offsets or offset < first_offsets[tp]):
                first_offsets[tp] = offset
        else:
            outcome["errors"].append(str(err))

    records = size = 0
    produce = producer.produce
    for row in rows:
        value = _as_bytes(row[i_value])
        key = _as_bytes(row[i_key]) if i_key is not None else None
        topic = spec.topic or (row[i_topic] if i_topic is not None else None)
        if not topic:
            raise ValueError(f"row {records} of batch {spec.batch_id} has no topic (null 'topic' column and no "
                             "'topic' option)")
        kwargs: dict[str, Any] = {"value": value, "key": key, "on_delivery": on_delivery}
        if i_partition is not None and row[i_partition] is not None:
            kwargs["partition"] = row[i_partition]
        # a header value arrives as bytearray from PySpark 3.5 (bytes from 4.x); confluent-kafka takes bytes only
        headers = [(h[0], _as_bytes(h[1])) for h in row[i_headers]] if i_headers is not None and row[i_headers] else []
        if provenance:
            headers = headers + provenance
        if headers:
            kwargs["headers"] = headers
        while True:
            try:
                produce(topic, **kwargs)
                break
            except BufferError:  # the local queue is full: let deliveries drain
                producer.poll(0.05)
        records += 1
        size += (len(value) if value else 0) + (len(key) if key else 0)
        if records % 10_000 == 0:
            producer.poll(0)
    return records, size, outcome


def _as_bytes(v: Any) -> bytes | None:
    if v is None or isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    return bytes(v)  # bytearray


class _EosStats:
    """librdkafka's statistics reports, as far as producer id and epoch go ("eos" section).

    The pair is taken from a report that shows this transaction in progress ("InTransaction",
    producer id assigned): the epoch is set by init_transactions and only changes (a bump) after an
    abortable error, which fails records (their delivery reports fail the task) and leaves
    "InTransaction". A report in the transaction that shows another pair fails the task.
    """

    def __init__(self) -> None:
        self.in_transaction = False
        self.pairs: set[tuple[int, int]] = set()  # seen in reports of this transaction
        self.last: dict[str, Any] | None = None

    def on_report(self, raw: str) -> None:
        eos = json.loads(raw).get("eos")
        if not eos:
            return
        self.last = eos
        if (self.in_transaction and eos.get("txn_state") == "InTransaction" and eos.get("idemp_state") == "Assigned"
                and eos.get("producer_id", -1) >= 0):
            self.pairs.add((int(eos["producer_id"]), int(eos["producer_epoch"])))

    def transaction_begun(self) -> None:
        self.in_transaction = True  # reports served from now on were queued after init_transactions
        self.pairs.clear()


def _producer_id_and_epoch(producer: Any, stats: _EosStats, spec: TaskSpec, partition: int) -> tuple[int, int]:
    """Of this transaction, after the flush and the delivery checks: from the reports served while
    it ran (every 20 ms; produce and flush serve them), or else the next one."""
    deadline = time.monotonic() + STATS_WAIT_S
    while not stats.pairs and time.monotonic() < deadline:
        producer.poll(STATS_INTERVAL_MS / 1000)
    if len(stats.pairs) == 1:
        return next(iter(stats.pairs))
    if not stats.pairs:
        raise RuntimeError(f"batch {spec.batch_id} partition {partition}: librdkafka reported no producer id in a "
                           f"transaction within {STATS_WAIT_S:.0f} s (last eos statistics: {stats.last}); the task "
                           "fails and Spark retries it")
    raise RuntimeError(f"batch {spec.batch_id} partition {partition}: the producer id/epoch changed during the "
                       f"transaction ({sorted(stats.pairs)}); the task fails and Spark retries it")
