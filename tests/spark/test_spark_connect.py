"""The writer as the foreachBatch function of a query started from a Spark Connect session (the local
Connect server pyspark ships, `pyspark[connect]`), against the real broker and coordinator.

Under Connect the function runs in a Python process of the server, attached to the client's
session; it has no `df.rdd` and no JVM: the write job runs through `mapInArrow`, each task's
partition comes from TaskContext, the run id from the session's active query (sparkclient/jobs.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.real_kafka import RealKafka, read_committed
from fixtures.servers import ServiceProcess
from fixtures.spark_support import (
    ADMIN,
    FailTask,
    kafka_service,
    module_database_url,  # noqa: F401 - fixture
    register,
    spark_session,
    write_input_files,
)
from sparkclient import CoordinatorClient, ExactlyOnceKafkaWriter

pytest.importorskip("pyarrow", reason="pyspark[connect] extras: pip install -e '.[test]'")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def connect() -> Iterator[Any]:
    """A Spark Connect session on pyspark's local Connect server (local[2,4]: 2 threads, a task is
    tried up to 4 times)."""
    session = spark_session("sparkclient-connect", master=None, remote="local[2,4]")
    assert type(session).__module__.startswith("pyspark.sql.connect"), type(session)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def service(module_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:  # noqa: F811
    # the coordinator's default Kafka timeouts: the 2 s of kafka_service's made registration's broker
    # check fail on 2 busy cores
    with kafka_service(module_database_url, tmp_path_factory.mktemp("coordinator"),
                       COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS="10000", COORDINATOR_KAFKA_RETRY_BUDGET_MS="30000") as s:
        yield s


def start_query(connect: Any, source: Path, checkpoint: Path, writer: Any, topic: str) -> Any:
    """The file source, one file per micro-batch; every Kafka-sink column, 3 partitions."""
    from pyspark.sql import functions as F

    n = F.col("n")
    rows = connect.readStream.schema("n INT").option("maxFilesPerTrigger", 1).json(str(source))
    out = rows.repartition(3).select(
        n.cast("string").cast("binary").alias("key"),
        F.when(n == 3, F.lit(None)).otherwise(n.cast("string")).cast("binary").alias("value"),  # a tombstone
        F.lit(topic).alias("topic"),
        (n % 3).cast("int").alias("partition"),
        F.array(F.struct(F.lit("trace").alias("key"), F.concat(F.lit("t"), n.cast("string")).cast("binary").alias("value")),
                F.struct(F.lit("empty").alias("key"), F.lit(None).cast("binary").alias("value"))).alias("headers"),
    )
    return out.writeStream.foreachBatch(writer).option("checkpointLocation", str(checkpoint)).start()


def wait_until_done(query: Any, files: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and query.isActive:
        progress = query.lastProgress
        if progress and progress["batchId"] >= files - 1 and not query.status["isTriggerActive"]:
            break
        time.sleep(0.5)
    query.stop()


def test_the_writer_runs_under_spark_connect_with_a_task_retried_after_its_precommit(
    connect: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    """Batch 0: partition 1's first task attempt fails after pre-committing; Spark retries it, the
    driver commits the attempt whose result `collect()` returned, the coordinator aborts the other.
    Batch 1 is empty: committed with no lease. Every column arrives as Spark gave it; read_committed
    sees each record once."""
    topic = real_kafka.create_topic(3)
    token = register(service, "connect", real_kafka.bootstrap, topic)
    batches = [list(range(0, 12)), [], list(range(12, 30))]
    write_input_files(tmp_path / "in", batches)
    writer = ExactlyOnceKafkaWriter({
        "kafka.bootstrap.servers": real_kafka.bootstrap, "topic": "", "coordinator.url": service.url,
        "coordinator.token": token, "coordinator.sink": "connect", "checkpointLocation": str(tmp_path / "chk"),
        "provenance.headers": "false",
    }, fault_hook=FailTask(frozenset({("after_precommit", 0, 1)})))
    query = start_query(connect, tmp_path / "in", tmp_path / "chk", writer, topic)
    wait_until_done(query, len(batches))
    assert query.exception() is None, query.exception()

    got = read_committed(real_kafka.bootstrap, topic)
    expected = [n for b in batches for n in b]
    assert sorted(int(m.key()) for m in got) == expected  # each record once
    for m in got:
        n = int(m.key())
        assert m.value() == (None if n == 3 else str(n).encode()) and m.partition() == n % 3, m
        assert m.headers() == [("trace", f"t{n}".encode()), ("empty", None)], m.headers()
    with CoordinatorClient(service.url, ADMIN, "connect") as c:
        assert sorted(cp["batch_id"] for cp in c.checkpoints()) == [0, 1, 2]
        assert c.checkpoint(1)["leases"] == []  # batch 1 (empty): no lease, no transaction
        leases = c.checkpoint(0)["leases"]
    retried = sorted(x["state"] for x in leases if x["partition"] == 1)
    assert retried == ["ABORTED", "COMMITTED"], leases  # two pre-committed attempts of one task, one winner
    assert {x["partition"] for x in leases if x["state"] == "COMMITTED"} == {0, 1, 2}


def test_a_checkpoint_location_of_no_running_query_is_refused_under_connect(
    connect: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    """The writer's checkpointLocation holds the id of a query that is not running in the session
    (a copy of another query's checkpoint): the first batch fails with LineageError, nothing is
    written and no generation is started."""
    topic = real_kafka.create_topic(1)
    token = register(service, "connect-lineage", real_kafka.bootstrap, topic)
    write_input_files(tmp_path / "in", [[1, 2, 3]])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metadata").write_text('{"id":"5d1c0c67-0000-4000-8000-000000000000"}\n')
    writer = ExactlyOnceKafkaWriter({
        "kafka.bootstrap.servers": real_kafka.bootstrap, "topic": topic, "coordinator.url": service.url,
        "coordinator.token": token, "coordinator.sink": "connect-lineage",
        "checkpointLocation": str(tmp_path / "other"),
    })
    query = start_query(connect, tmp_path / "in", tmp_path / "chk", writer, topic)
    try:
        query.awaitTermination(240)
    except Exception:  # noqa: BLE001 - StreamingQueryException; looked at below
        pass
    error = str(query.exception())
    assert "LineageError" in error and "not running in this Spark Connect session" in error, error
    with CoordinatorClient(service.url, ADMIN, "connect-lineage") as c:
        assert c.describe_sink()["generation"] == 0 and c.checkpoints() == []
    assert read_committed(real_kafka.bootstrap, topic) == []


def test_the_native_sink_under_spark_connect(connect: Any, service: ServiceProcess, real_kafka: RealKafka,
                                             tmp_path: Path) -> None:
    """`.format("kafka_eos")` registered from a Connect client (the class travels to the server):
    every Kafka-sink column (no topic option), a tombstone, a retried task; each record once."""
    from pyspark.sql import functions as F

    from sparkclient.sink import register_sink

    topic = real_kafka.create_topic(3)
    token = register(service, "connect-native", real_kafka.bootstrap, topic)
    batches = [list(range(0, 12)), list(range(12, 30))]
    write_input_files(tmp_path / "in", batches)
    name = register_sink(connect, fault_hook=FailTask(frozenset({("after_precommit", 1, 2)})))
    n = F.col("n")
    rows = connect.readStream.schema("n INT").option("maxFilesPerTrigger", 1).json(str(tmp_path / "in"))
    out = rows.repartition(3).select(
        n.cast("string").alias("key"),
        F.when(n == 3, F.lit(None)).otherwise(n.cast("string")).alias("value"),
        F.lit(topic).alias("topic"), (n % 3).cast("int").alias("partition"),
        F.array(F.struct(F.lit("trace").alias("key"), F.concat(F.lit("t"), n.cast("string")).cast("binary").alias("value"))
                ).alias("headers"))
    query = (out.writeStream.format(name).option("kafka.bootstrap.servers", real_kafka.bootstrap)
             .option("coordinator.url", service.url).option("coordinator.token", token)
             .option("coordinator.sink", "connect-native").option("checkpointLocation", str(tmp_path / "chk"))
             .trigger(availableNow=True).start())
    query.awaitTermination(240)
    assert query.exception() is None, query.exception()
    got = read_committed(real_kafka.bootstrap, topic)
    assert sorted(int(m.key()) for m in got) == [v for b in batches for v in b]
    for m in got:
        k = int(m.key())
        assert m.value() == (None if k == 3 else str(k).encode()) and m.partition() == k % 3, m
        assert m.headers() == [("trace", f"t{k}".encode())], m.headers()
    with CoordinatorClient(service.url, ADMIN, "connect-native") as c:
        leases = c.checkpoint(1)["leases"]
    assert sorted(x["state"] for x in leases if x["partition"] == 2) == ["ABORTED", "COMMITTED"], leases
