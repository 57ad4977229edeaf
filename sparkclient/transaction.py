"""One Kafka transaction on one leased transactional id, left open for the coordinator's commit.

`init_transactions` -> `begin_transaction` -> produce (sparkclient/produce.py) -> `flush` -> every
delivery report checked (a transaction that lost a record is never handed on) -> producer id and
epoch -> the producer released WITHOUT ending the transaction. confluent-kafka 2.16's
`Producer.close()` aborts an ongoing transaction, so the last reference is dropped instead (the
handle's dealloc destroys librdkafka's instance and its threads and leaves the transaction open);
a failed try aborts its own transaction and closes its producer.

Producer id and epoch: librdkafka has no API for them. Its statistics carry them, but only in a
report emitted on a timer (the writer used to wait 10-12 ms per task for one). Its debug log of
the `eos` context says them at once: `GETPID ... Acquired PID{Id:12,Epoch:3}` when
`init_transactions` gets them, and `NEWPID ... -> PID{Id:12,Epoch:3}` when a partition starts
producing with them; log lines reach the producer's `logger` through the queue `poll()` and
`flush()` serve, before the delivery reports queued after them. The task takes the one pair
acquired and fails if another was acquired, a partition produced with another, or librdkafka
logged a transaction error (TXNERR). About 60 log lines per transaction, whatever its size.
Pinned with confluent-kafka 2.16.1 / librdkafka 2.16.0 and tested against a real broker
(tests/spark/test_spark_executor.py); a version that logs otherwise fails the task loudly.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .produce import Columns, Deliveries, ProduceTarget, Produced, produce_batches

log = logging.getLogger(__name__)

KAFKA_CALL_TIMEOUT_S = 60.0
FLUSH_STEP_S = 0.2  # how often a flush looks whether a record already failed
ABORT_TIMEOUT_S = 10.0
_PID = re.compile(r"PID\{Id:(\d+),Epoch:(\d+)\}")


class DeliveryFailed(RuntimeError):
    """A record of the transaction was not acknowledged; the task fails and Spark retries it."""


class ProducerIdUnknown(RuntimeError):
    """librdkafka's log did not name exactly one producer id and epoch for the transaction."""


class EosLog:
    """The producer's `logger` (with `debug=eos`): keeps what names the producer id and epoch and
    any transaction error; passes librdkafka's warnings and errors on to this module's logger."""

    def __init__(self) -> None:
        self.acquired: list[tuple[int, int]] = []  # GETPID "Acquired PID{...}"
        self.produced_with: set[tuple[int, int]] = set()  # NEWPID "... -> PID{...}"
        self.errors: list[str] = []  # TXNERR at warning level or above

    def log(self, level: int, fmt: str, *args: Any) -> None:
        facility, message = (str(args[0]), str(args[2])) if len(args) >= 3 else ("", fmt % args)
        if facility == "GETPID" and "Acquired" in message:
            self.acquired.append(_pid(_PID.findall(message)[0]))
        elif facility == "NEWPID":
            found = _PID.findall(message)
            if found:
                self.produced_with.add(_pid(found[-1]))
        if level >= logging.WARNING:
            if facility == "TXNERR":
                self.errors.append(message)
            log.log(level, fmt, *args)

    def producer_id_and_epoch(self, where: str) -> tuple[int, int]:
        if len(self.acquired) != 1:
            raise ProducerIdUnknown(
                f"{where}: librdkafka's eos log named {len(self.acquired)} producer id/epoch pairs acquired "
                f"({self.acquired}), expected exactly one; the task fails and Spark retries it (a librdkafka that "
                "logs otherwise than the pinned 2.16.0 fails here: pin confluent-kafka as pyproject.toml does)")
        pair = self.acquired[0]
        if self.produced_with - {pair}:
            raise ProducerIdUnknown(f"{where}: partitions produced with {sorted(self.produced_with)}, not only the "
                                    f"acquired {pair}; the task fails and Spark retries it")
        return pair


def _pid(found: tuple[str, str]) -> tuple[int, int]:
    return int(found[0]), int(found[1])


@dataclass(frozen=True)
class ProducerSettings:
    bootstrap_servers: str
    config: dict[str, Any]  # the user's kafka.* options over the writer's defaults
    transactional_id: str
    transaction_timeout_ms: int
    init_timeout_ms: int
    request_timeout_ms: int | None


@dataclass(frozen=True)
class Written:
    """A flushed transaction, every record acknowledged, still open."""

    produced: Produced
    write_ms: int
    producer_id: int
    producer_epoch: int
    first_offsets: list[list[Any]]


def producer_socket_timeout_ms(request_timeout_ms: int | None, transaction_timeout_ms: int) -> int:
    """librdkafka refuses a transactional producer whose socket.timeout.ms (default 60 s) is above
    transaction.timeout.ms + 100, so a sink with a shorter transaction timeout lowers it. Lowering
    only shortens how long a stalled request can act, which keeps the id quarantine's bound."""
    return min(request_timeout_ms or 60_000, transaction_timeout_ms + 100)


def new_producer(settings: ProducerSettings, deliveries: Deliveries, eos: EosLog) -> Any:
    from confluent_kafka import KafkaException, Producer

    config = {
        **settings.config,
        "socket.timeout.ms": producer_socket_timeout_ms(settings.request_timeout_ms, settings.transaction_timeout_ms),
        "bootstrap.servers": settings.bootstrap_servers,
        "transactional.id": settings.transactional_id,
        "transaction.timeout.ms": settings.transaction_timeout_ms,  # the sink's: the commit gate's deadline
        "enable.idempotence": True,
        "acks": "all",
        "on_delivery": deliveries.on_delivery,
        "debug": _with_eos(settings.config.get("debug")),
        "logger": eos,
    }
    try:
        return Producer(config)
    except KafkaException as exc:
        raise KafkaException(f"{exc.args[0]} -- check the kafka.* options: they are librdkafka's settings "
                             "(https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md), "
                             "e.g. kafka.message.max.bytes where Java's producer says max.request.size") from exc


def flush(producer: Any, deliveries: Deliveries, eos: EosLog) -> int:
    """`flush()`, ended early once a record failed: the transaction is lost then, and librdkafka
    would hold the records queued after the failure until they time out (the transaction timeout,
    60 s by default) before it gave them back. Returns the records still queued."""
    deadline = time.monotonic() + KAFKA_CALL_TIMEOUT_S
    while True:
        left = producer.flush(FLUSH_STEP_S)
        if not left or deliveries.failed or eos.errors or time.monotonic() >= deadline:
            return int(left)


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection while records are produced and delivered. Every delivery
    report allocates a Message and its arguments (objects the collector tracks), so a collection
    starts every few hundred records, and each one walks the young generation, which holds the
    record batch's column lists (10,000 items each): measured, that was most of a Python worker's
    CPU. Nothing in the loop makes reference cycles; what was allocated is freed by reference
    counting, and the collector runs again as before once the flush is done."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _with_eos(debug: Any) -> str:
    contexts = [c for c in str(debug or "").split(",") if c.strip()]
    return ",".join(dict.fromkeys([*contexts, "eos"]))


def write(settings: ProducerSettings, first: Any, rest: Iterator[Any], columns: Columns, target: ProduceTarget,
          batch_id: int, where: str, before_handing_on: Any) -> Written:
    """Write every record batch (`first`, then `rest`) in one transaction and leave it open.
    `before_handing_on()` runs last, with the transaction flushed and checked (the deadline check
    and the test hook); anything it raises aborts the transaction."""
    from itertools import chain

    deliveries, eos = Deliveries(), EosLog()
    producer = new_producer(settings, deliveries, eos)
    try:
        started = time.monotonic()
        producer.init_transactions(settings.init_timeout_ms / 1000)
        producer.begin_transaction()
        with collector_paused():
            produced = produce_batches(producer, chain([first], rest), columns, target, batch_id)
            left = flush(producer, deliveries, eos)
        delivered_all = not left and not deliveries.failed and not eos.errors
        if not delivered_all:
            raise DeliveryFailed(
                f"{where}: {produced.records} records produced, {left} still queued, {deliveries.failed} failed "
                f"({deliveries.errors}), transaction errors {eos.errors[:3]}; the task fails so that Spark retries it "
                "(this transaction is never committed)")
        write_ms = int((time.monotonic() - started) * 1000)
        producer_id, producer_epoch = eos.producer_id_and_epoch(where)
        before_handing_on()
    except BaseException:
        # a failed try is never a winner: end its transaction now rather than leave it to the
        # coordinator (close() would abort it too; abort_transaction first bounds the wait)
        for end in (lambda: producer.abort_transaction(ABORT_TIMEOUT_S), producer.close):
            try:
                end()
            except Exception as exc:  # noqa: BLE001 - the failure being raised matters more
                log.info("%s: ending the failed try's producer: %s", where, exc)
        raise
    del producer  # released with its transaction open (see the module's docstring)
    return Written(produced, write_ms, producer_id, producer_epoch, deliveries.reported_first_offsets())
