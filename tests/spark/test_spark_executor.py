"""The executor core without Spark around it (sparkclient/executor.py, transaction.py, produce.py):
a task over Arrow record batches, as a reused Python worker runs it, against the real coordinator
(uvicorn on Postgres, committing by EndTxn) and a real Kafka broker. What the broker's own log
says (COMMIT markers from the producer id and epoch the task reported, open transactions, what a
read_committed consumer sees) is the judge.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from fixtures.kafka_producers import partition_log, settled_partition_log
from fixtures.real_kafka import RealKafka, read_committed
from fixtures.servers import ServiceProcess
from fixtures.spark_support import module_database_url, register, service  # noqa: F401 - fixture
from sparkclient import CoordinatorClient, DeliveryFailed
from sparkclient.executor import BatchAttempt, Coordinator, TaskSpec, TaskTry, WriteSettings, write_task

pa = pytest.importorskip("pyarrow")
pytestmark = pytest.mark.slow


def spec_for(service: ServiceProcess, token: str, sink: str, bootstrap: str, topic: str | None, columns: tuple[str, ...],
             begun: dict[str, Any], batch_id: int, generation: int, *, provenance: bool = True,
             producer_config: dict[str, Any] | None = None) -> TaskSpec:
    settings = WriteSettings(Coordinator(service.url, token, sink, 30_000, 60_000), bootstrap,
                             {"linger.ms": 5, **(producer_config or {})}, topic, columns, provenance)
    return TaskSpec(settings, BatchAttempt.of_begin(batch_id, generation, begun))


def kv_batches(prefix: str, n: int, per_batch: int = 20) -> list[Any]:
    rows = [(f"k{prefix}-{i}", f"v{prefix}-{i}") for i in range(n)]
    return [pa.record_batch([pa.array([k for k, _ in rows[i:i + per_batch]]),
                             pa.array([v for _, v in rows[i:i + per_batch]])], names=["key", "value"])
            for i in range(0, n, per_batch)]


def native_threads() -> int:
    """librdkafka's threads in this process (named rdk:main, rdk:broker…); other threads of the
    pytest process come and go on their own."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sum(name.startswith("rdk:") for name in names)


def test_a_task_leaves_no_producer_behind_its_transaction_open_and_names_the_producer_that_wrote_it(
    service: ServiceProcess, real_kafka: RealKafka
) -> None:
    """Three batches in one process (a reused worker): each task's lease comes from the lease route
    under its task attempt id; after it the process has the librdkafka threads it had before (the
    producer is gone), the transaction is still open (released, not ended: the coordinator's
    resume-commit succeeds), and the broker's COMMIT marker carries the producer id the task read
    from librdkafka's eos log. An empty partition takes no lease and makes no producer."""
    import gc

    topic = real_kafka.create_topic(1)
    token = register(service, "core-tasks", real_kafka.bootstrap, topic)
    with CoordinatorClient(service.url, token, "core-tasks") as c:
        gen = c.start_generation("query-tasks", "run-1")["generation"]
        before = native_threads()
        for batch in range(3):
            begun = c.begin(batch, gen)
            spec = spec_for(service, token, "core-tasks", real_kafka.bootstrap, topic, ("key", "value"), begun, batch, gen)
            result = write_task(spec, TaskTry(0, 500 + batch, 0), kv_batches(str(batch), 50))
            gc.collect()
            assert native_threads() == before, f"batch {batch}: threads left behind"
            assert result.records == 50 and result.lease_id is not None and result.task_attempt_id == 500 + batch
            assert result.precommit_record()["task_attempt_id"] == 500 + batch
            assert partition_log(real_kafka.bootstrap, topic, 0).has_open_transaction  # released, not ended
            assert [x[:2] for x in result.first_offsets] == [[topic, 0]] and result.producer_id is not None
            answer = c.commit(batch, begun["attempt"], gen, {0: result.lease_id}, records={0: result.precommit_record()})
            assert answer["state"] == "COMMITTED" and answer["committed"][0]["records"] == 50
            log = settled_partition_log(real_kafka.bootstrap, topic, 0)
            assert not log.has_open_transaction
            assert log.markers(result.producer_id)[-1] == "commit"
            assert [(b.producer_id, b.producer_epoch) for b in log.batches if b.marker is None][-1] == (
                result.producer_id, result.producer_epoch)
        no_rows = pa.record_batch([pa.array([], pa.string()), pa.array([], pa.string())], names=["key", "value"])
        empty = write_task(spec, TaskTry(4, 900, 0), [no_rows, no_rows])
        assert empty.lease_id is None and native_threads() == before
        assert len(c.checkpoint(2)["leases"]) == 1  # the empty partition asked for nothing
    assert len(read_committed(real_kafka.bootstrap, topic)) == 150


def test_a_task_reports_the_first_offset_of_a_few_topic_partitions_only(
    service: ServiceProcess, real_kafka: RealKafka
) -> None:
    """A transaction that wrote six partitions (the `partition` column): its record names the first
    offset it wrote in FIRST_OFFSETS_REPORTED of them, each the offset of the transaction's first
    record there (two records of another producer precede it in partitions 1 and 3); the commit
    carrying it succeeds and every partition's records are committed."""
    from confluent_kafka import Producer

    from coordinator.protocol.model import FIRST_OFFSETS_KEPT
    from sparkclient.produce import FIRST_OFFSETS_REPORTED

    assert FIRST_OFFSETS_REPORTED == FIRST_OFFSETS_KEPT == 4
    topic = real_kafka.create_topic(6)
    plain = Producer({"bootstrap.servers": real_kafka.bootstrap})
    for p in (1, 3):
        for i in range(2):
            plain.produce(topic, f"before-{i}".encode(), partition=p)
    assert plain.flush(30) == 0
    token = register(service, "core-wide", real_kafka.bootstrap, topic)
    with CoordinatorClient(service.url, token, "core-wide") as c:
        gen = c.start_generation("query-wide", "run-1")["generation"]
        begun = c.begin(0, gen)
        spec = spec_for(service, token, "core-wide", real_kafka.bootstrap, topic, ("key", "value", "partition"), begun, 0,
                        gen)
        rows = [(f"k{p}-{i}", f"v{p}-{i}", p) for p in (5, 4, 3, 2, 1, 0) for i in range(3)]
        batch = pa.record_batch([pa.array([r[0] for r in rows]), pa.array([r[1] for r in rows]),
                                 pa.array([r[2] for r in rows], pa.int32())], names=["key", "value", "partition"])
        result = write_task(spec, TaskTry(0, 1, 0), [batch])
        assert result.records == 18
        first_in = {0: 0, 1: 2, 2: 0, 3: 2, 4: 0, 5: 0}
        assert len(result.first_offsets) == 4 and all(t == topic and o == first_in[p] for t, p, o in result.first_offsets)
        answer = c.commit(0, begun["attempt"], gen, {0: result.lease_id}, records={0: result.precommit_record()})
        assert answer["state"] == "COMMITTED"
    for p in range(6):  # every partition's records committed, not only the reported ones'
        log = settled_partition_log(real_kafka.bootstrap, topic, p)
        assert not log.has_open_transaction and log.markers(result.producer_id) == ["commit"], p


def test_every_column_of_spark_s_kafka_sink_from_arrow(service: ServiceProcess, real_kafka: RealKafka) -> None:
    """binary and string keys and values, a null value (a tombstone), the `topic` column (no topic
    option), the `partition` column with a null (the partitioner decides), `headers` with a null
    header value and an empty list, plus the provenance headers: as a read_committed consumer reads them."""
    topic = real_kafka.create_topic(3)
    token = register(service, "core-columns", real_kafka.bootstrap, topic)
    headers_type = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    batch = pa.record_batch([
        pa.array([b"k0", b"k1", b"k2", None], pa.binary()),
        pa.array(["v0", None, "v2", "v3"], pa.large_string()),
        pa.array([topic] * 4),
        pa.array([2, 1, None, 0], pa.int32()),
        pa.array([[{"key": "trace", "value": b"t0"}, {"key": "empty", "value": None}], [], None,
                  [{"key": "trace", "value": b"t3"}]], headers_type),
    ], names=["key", "value", "topic", "partition", "headers"])
    with CoordinatorClient(service.url, token, "core-columns") as c:
        gen = c.start_generation("query-columns", "run-1")["generation"]
        begun = c.begin(0, gen)
        spec = spec_for(service, token, "core-columns", real_kafka.bootstrap, None,
                        ("key", "value", "topic", "partition", "headers"), begun, 0, gen)
        result = write_task(spec, TaskTry(0, 1, 0), [batch])
        assert result.records == 4 and result.bytes == 2 * 3 + 2 * 3
        c.commit(0, begun["attempt"], gen, {0: result.lease_id}, records={0: result.precommit_record()})
    got = {m.value(): m for m in read_committed(real_kafka.bootstrap, topic)}
    provenance = [("eos-sink", b"core-columns"), ("eos-batch-id", b"0"), ("eos-attempt", str(begun["attempt"]).encode()),
                  ("eos-lease-id", str(result.lease_id).encode())]
    assert got[b"v0"].key() == b"k0" and got[b"v0"].partition() == 2
    assert got[b"v0"].headers() == [("trace", b"t0"), ("empty", None), *provenance]
    assert got[None].key() == b"k1" and got[None].partition() == 1 and got[None].headers() == provenance
    assert got[b"v2"].headers() == provenance
    assert got[b"v3"].key() is None and got[b"v3"].partition() == 0
    assert got[b"v3"].headers() == [("trace", b"t3"), *provenance]


def test_a_record_the_broker_refuses_fails_the_task_and_its_transaction_is_aborted(
    service: ServiceProcess, real_kafka: RealKafka
) -> None:
    """Every delivery report is checked: the broker refuses one record of the batch (larger than the
    topic's max.message.bytes), so the task raises DeliveryFailed instead of returning a record, as
    soon as the failure is known;
    the driver's abort of the attempt ends its transaction (on a transaction.version=2 broker the
    task's own abort is fenced: librdkafka speaks version 1), and nothing of it ever becomes visible."""
    topic = real_kafka.create_topic(1, **{"max.message.bytes": "2000"})
    token = register(service, "core-refused", real_kafka.bootstrap, topic)
    values = ["small"] * 30 + ["x" * 5000] + ["small"] * 30
    batch = pa.record_batch([pa.array([str(i) for i in range(len(values))]), pa.array(values)], names=["key", "value"])
    with CoordinatorClient(service.url, token, "core-refused") as c:
        gen = c.start_generation("query-refused", "run-1")["generation"]
        begun = c.begin(0, gen)
        spec = spec_for(service, token, "core-refused", real_kafka.bootstrap, topic, ("key", "value"), begun, 0, gen,
                        producer_config={"batch.size": 1000})  # the big record travels in a batch of its own
        started = time.monotonic()
        with pytest.raises(DeliveryFailed, match=r"61 records produced, \d+ still queued, [1-9]\d* failed") as failed:
            write_task(spec, TaskTry(0, 1, 0), [batch])
        assert "too large" in str(failed.value).lower(), failed.value
        # it fails at once, not when the records queued after the failure time out with the transaction (60 s)
        assert time.monotonic() - started < 30
        c.abort(0, begun["attempt"], gen, "the write job failed")  # what the driver does then
    log = settled_partition_log(real_kafka.bootstrap, topic, 0)
    assert not log.has_open_transaction and {b.marker for b in log.batches if b.marker} <= {"abort"}
    assert read_committed(real_kafka.bootstrap, topic) == []


def test_a_sink_with_a_transaction_timeout_below_the_producer_request_timeout_writes(
    service: ServiceProcess, real_kafka: RealKafka
) -> None:
    """librdkafka refuses a transactional producer whose socket.timeout.ms is above
    transaction.timeout.ms + 100 (the coordinator hands tasks a 60 s request timeout): a sink with a
    40 s transaction timeout still writes and commits, and the producer's own check is what the
    broken variant (the request timeout passed as is) runs into."""
    from confluent_kafka import KafkaException, Producer

    from sparkclient.transaction import producer_socket_timeout_ms

    topic = real_kafka.create_topic(1)
    token = register(service, "core-short-timeout", real_kafka.bootstrap, topic, transaction_timeout_ms=40_000)
    with pytest.raises(KafkaException, match="socket.timeout.ms"):  # what a task ran into before
        Producer({"bootstrap.servers": real_kafka.bootstrap, "transactional.id": "short-timeout-probe",
                  "transaction.timeout.ms": 40_000, "socket.timeout.ms": 60_000})
    with CoordinatorClient(service.url, token, "core-short-timeout") as c:
        gen = c.start_generation("query-short", "run-1")["generation"]
        begun = {**c.begin(0, gen), "producer_request_timeout_ms": 60_000}
        spec = spec_for(service, token, "core-short-timeout", real_kafka.bootstrap, topic, ("key", "value"), begun, 0, gen)
        result = write_task(spec, TaskTry(0, 1, 0), kv_batches("s", 5))
        answer = c.commit(0, begun["attempt"], gen, {0: result.lease_id}, records={0: result.precommit_record()})
    assert answer["state"] == "COMMITTED" and answer["committed"][0]["records"] == 5
    assert sorted(m.value() for m in read_committed(real_kafka.bootstrap, topic)) == [f"vs-{i}".encode() for i in range(5)]
    assert producer_socket_timeout_ms(60_000, 40_000) == 40_100
    assert producer_socket_timeout_ms(5_000, 40_000) == 5_000
