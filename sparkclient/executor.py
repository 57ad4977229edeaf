"""Executor side: one Spark task attempt writes one partition of a batch in one Kafka transaction.

Per task attempt (DESIGN §3 steps 3-4): an empty partition takes no lease and opens no transaction;
otherwise lease a transactional id for this task attempt, `init_transactions`, `begin_transaction`,
produce every row, `flush`, check every delivery report (any failure fails the task: a transaction
that lost a record is never pre-committed), read producer id and epoch from librdkafka's
statistics (`eos.producer_id`, `eos.producer_epoch`: the only place it exposes them), pre-commit,
and release the producer WITHOUT ending the transaction (not `close()`, which aborts it): the
coordinator commits the winner by resume. The task's
result names its lease; the driver commits with the results Spark accepted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from .client import CoordinatorClient

log = logging.getLogger(__name__)

# Provenance headers (option provenance.headers): which sink, batch, attempt and lease (task
# attempt's transaction) wrote a record. A lease id is unique per coordinator database.
HEADER_SINK = "eos-sink"
HEADER_BATCH = "eos-batch-id"
HEADER_ATTEMPT = "eos-attempt"
HEADER_LEASE = "eos-lease-id"

STATS_INTERVAL_MS = 20  # librdkafka statistics: how producer id and epoch are learnt after the flush
KAFKA_CALL_TIMEOUT_S = 60.0

FaultHook = Callable[..., None]


class DeliveryFailed(RuntimeError):
    """A record of the transaction was not acknowledged; the task fails and Spark retries it."""


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

    def client(self) -> CoordinatorClient:
        return CoordinatorClient(self.coordinator_url, self.coordinator_token, self.sink,
                                 timeout_s=self.request_timeout_ms / 1000, retry_budget_s=self.retry_budget_ms / 1000)


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


def write_partition(spec: TaskSpec, partition: int, rows: Iterable[Any]) -> Iterator[TaskResult]:
    """The body of `mapPartitionsWithIndex` on the batch's rows."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    task_attempt_id = ctx.taskAttemptId() if ctx else 0
    attempt_number = ctx.attemptNumber() if ctx else 0
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        yield TaskResult(partition, None, task_attempt_id)
        return
    hook = _hook(spec, partition, attempt_number)
    with spec.client() as client:
        lease = client.lease(spec.batch_id, spec.attempt, spec.generation, partition, task_attempt_id)
        hook("after_lease", lease=lease)
        result = _write_transaction(spec, partition, task_attempt_id, lease, chain([first], rows), client, hook)
    hook("after_precommit", result=result)
    yield result


def _hook(spec: TaskSpec, partition: int, attempt_number: int) -> Callable[..., None]:
    def call(step: str, **info: Any) -> None:
        if spec.fault_hook is not None:
            spec.fault_hook(step, batch_id=spec.batch_id, partition=partition, task_attempt=attempt_number, **info)
    return call


def _write_transaction(spec: TaskSpec, partition: int, task_attempt_id: int, lease: dict[str, Any],
                       rows: Iterator[Any], client: CoordinatorClient, hook: Callable[..., None]) -> TaskResult:
    from confluent_kafka import Producer

    stats: dict[str, Any] = {}

    def on_stats(raw: str) -> None:
        eos = json.loads(raw).get("eos")
        if eos:
            stats["eos"] = eos

    producer = Producer({
        **spec.producer_config,
        "bootstrap.servers": spec.bootstrap_servers,
        "transactional.id": lease["transactional_id"],
        "transaction.timeout.ms": lease["transaction_timeout_ms"],  # the sink's: the commit gate's deadline
        "enable.idempotence": True,
        "acks": "all",
        "statistics.interval.ms": STATS_INTERVAL_MS,
        "stats_cb": on_stats,
    })
    try:
        started = time.monotonic()
        producer.init_transactions(KAFKA_CALL_TIMEOUT_S)
        producer.begin_transaction()
        records, size, failures = _produce_rows(spec, lease, producer, rows)
        left = producer.flush(KAFKA_CALL_TIMEOUT_S)
        if left or failures["errors"] or failures["delivered"] != records:
            raise DeliveryFailed(
                f"batch {spec.batch_id} partition {partition}: {failures['delivered']} of {records} records "
                f"acknowledged, {left} still queued, errors: {failures['errors'][:5]}; the task fails so that "
                "Spark retries it (this transaction is never committed)")
        write_ms = int((time.monotonic() - started) * 1000)
        producer_id, producer_epoch = _producer_id_and_epoch(producer, stats)
        hook("before_precommit", lease=lease)
        client.precommit(lease["lease_id"], spec.generation, producer_id, producer_epoch, records, size, write_ms)
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
    return TaskResult(partition, lease["lease_id"], task_attempt_id, records, size, write_ms, lease["transactional_id"])


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
    outcome: dict[str, Any] = {"delivered": 0, "errors": []}

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is None:
            outcome["delivered"] += 1
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
        headers = [(h[0], h[1]) for h in row[i_headers]] if i_headers is not None and row[i_headers] else []
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


def _producer_id_and_epoch(producer: Any, stats: dict[str, Any]) -> tuple[int, int]:
    """From a statistics report emitted after the flush (librdkafka has no other API for them)."""
    stats.clear()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        producer.poll(STATS_INTERVAL_MS / 1000)
        eos = stats.get("eos")
        if eos and eos.get("producer_id", -1) >= 0:
            return int(eos["producer_id"]), int(eos["producer_epoch"])
    raise RuntimeError(f"librdkafka reported no producer id within 30 s (last eos statistics: {stats.get('eos')})")
