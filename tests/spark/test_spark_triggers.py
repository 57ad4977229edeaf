"""The writer behind Spark's own Kafka source (`kafka.isolation.level=read_committed`) on the real
broker, with the triggers users run: availableNow (a backfill that ends when caught up) and
processingTime. A batch whose offsets hold only an aborted transaction and markers has no row: it
is begun and committed with no lease and no transaction, and no Spark job checks its emptiness
first (counted on the driver's client; a check would also re-poll the aborted range).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.real_kafka import RealKafka, read_committed
from fixtures.servers import ServiceProcess
from fixtures.spark_support import module_database_url, register, service, spark_session  # noqa: F401 - fixture
from sparkclient import BatchReport, CoordinatorClient, ExactlyOnceKafkaWriter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("sparkclient-triggers")  # with Spark's Kafka connector
    yield session
    session.stop()


class CountingClient(CoordinatorClient):
    """The driver's client, recording every call it sends (executors have their own)."""

    calls: list[str]

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        self.calls.append(f"{method} {path.rsplit('/', 1)[-1] if '/checkpoints/' not in path else path.split('/checkpoints/')[1]}")
        return super().request(method, path, body, **kwargs)


def transaction(bootstrap: str, topic: str, values: range, commit: bool) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"input-{topic}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for v in values:
        producer.produce(topic, key=str(v), value=str(v))
    producer.flush(30)
    (producer.commit_transaction if commit else producer.abort_transaction)(30)


def kafka_query(spark: Any, bootstrap: str, topic: str, checkpoint: Path, writer: Any, **trigger: Any) -> Any:
    rows = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
            .option("startingOffsets", "earliest").option("kafka.isolation.level", "read_committed")
            .option("maxOffsetsPerTrigger", 11)
            # a range holding only aborted records: Spark's consumer polls until this timeout (default 120 s)
            .option("kafkaConsumer.pollTimeoutMs", 3000).load())
    return (rows.select("key", "value").writeStream.foreachBatch(writer).option("checkpointLocation", str(checkpoint))
            .trigger(**trigger).start())


@pytest.mark.timeout(900)  # two queries, six batches, on 2 busy cores
def test_kafka_source_with_available_now_then_processing_time_and_an_empty_batch(
    spark: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    bootstrap = real_kafka.bootstrap
    source, target = real_kafka.create_topic(1), real_kafka.create_topic(2)
    token = register(service, "triggers", bootstrap, target)
    # offsets 0-9 committed + marker 10 | 11-20 aborted + marker 21 | 22-31 committed + marker 32;
    # 11 offsets per batch: batch 1 holds only the aborted transaction and its marker
    transaction(bootstrap, source, range(0, 10), commit=True)
    transaction(bootstrap, source, range(100, 110), commit=False)
    transaction(bootstrap, source, range(10, 20), commit=True)
    reports: list[BatchReport] = []
    writer = ExactlyOnceKafkaWriter({
        "kafka.bootstrap.servers": bootstrap, "topic": target, "coordinator.url": service.url,
        "coordinator.token": token, "coordinator.sink": "triggers", "checkpointLocation": str(tmp_path / "chk"),
    }, on_batch=reports.append)
    client = writer._client = CountingClient(service.url, token, "triggers")
    client.calls = []
    calls_per_batch: list[list[str]] = []

    def each_batch(df: Any, batch_id: int) -> None:
        before = len(client.calls)
        writer(df, batch_id)
        calls_per_batch.append(client.calls[before:])

    # availableNow: the backfill runs every batch the input holds, then the query ends by itself
    query = kafka_query(spark, bootstrap, source, tmp_path / "chk", each_batch, availableNow=True)
    assert query.awaitTermination(240), "availableNow did not end"
    assert query.exception() is None, query.exception()
    assert [(r.batch_id, r.action, r.records) for r in reports] == [(0, "committed", 10), (1, "empty", 0),
                                                                   (2, "committed", 10)]
    assert calls_per_batch == [
        ["GET triggers", "POST generations", "POST 0/begin", "POST 0/attempts/1/commit"],
        ["POST 1/begin", "POST 1/attempts/1/commit"],  # the empty batch: no lease, no transaction
        ["POST 2/begin", "POST 2/attempts/1/commit"],
    ]
    with CoordinatorClient(service.url, token, "triggers") as c:
        assert sorted(cp["batch_id"] for cp in c.checkpoints()) == [0, 1, 2]
        assert c.checkpoint(1)["leases"] == []

    # processingTime on the same checkpoint: only what is new, then idle batches cost nothing
    transaction(bootstrap, source, range(20, 30), commit=True)
    query = kafka_query(spark, bootstrap, source, tmp_path / "chk", each_batch, processingTime="500 milliseconds")
    deadline = time.monotonic() + 240
    while len(reports) < 4 and time.monotonic() < deadline and query.isActive:
        time.sleep(0.2)
    calls_when_caught_up = len(client.calls)
    time.sleep(3)  # six triggers with nothing new
    query.stop()
    assert query.exception() is None, query.exception()
    assert [(r.batch_id, r.action, r.records) for r in reports[3:]] == [(3, "committed", 10)]
    assert calls_per_batch[3][0] == "POST generations"  # a new run of the query: a new generation
    assert len(client.calls) == calls_when_caught_up
    got = read_committed(bootstrap, target)
    assert sorted(int(m.value()) for m in got) == list(range(30))  # each committed input record once
