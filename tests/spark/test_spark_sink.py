"""The native sink (`.writeStream.format("kafka_eos")`, sparkclient/sink.py) in real PySpark
streaming queries (classic, local mode) against the real coordinator (uvicorn on Postgres,
committing by EndTxn) and a real Kafka broker. Exactly-once is what a read_committed consumer sees,
cross-checked with the coordinator's records, the provenance headers and the broker's COMMIT
markers (tests/fixtures/spark_support.py). The crash test is tests/spark/test_spark_sink_crash.py; the
sink under Spark Connect is in tests/spark/test_spark_connect.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.real_kafka import RealKafka
from fixtures.servers import ServiceProcess
from fixtures.spark_support import (
    ADMIN,
    FailTask,
    assert_exactly_once,
    module_database_url,  # noqa: F401 - fixture
    service,  # noqa: F401 - fixture
    outcome,
    read_topic,
    register,
    spark_session,
    write_input_files,
)
from sparkclient import CoordinatorClient

pytest.importorskip("pyspark.sql.datasource", reason="the Python Data Source API (pyspark 4.x)")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("sparkclient-sink", **{"spark.python.unix.domain.socket.enabled": "true"})
    yield session
    session.stop()


def run_sink_query(spark: Any, source: Path, checkpoint: Path, options: dict[str, str], partitions: int = 3,
                   fault_hook: Any = None) -> Any:
    """The file source, one file per micro-batch, through the sink until every file is processed."""
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import functions as F

    from sparkclient.sink import register_sink

    name = register_sink(spark, fault_hook=fault_hook)
    rows = spark.readStream.schema("n INT").option("maxFilesPerTrigger", 1).json(str(source))
    out = rows.repartition(partitions).select(F.col("n").cast("string").alias("key"),
                                              F.col("n").cast("string").alias("value"))
    query = (out.writeStream.format(name).options(**options).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    try:
        query.awaitTermination(240)
    except StreamingQueryException:
        pass  # the caller looks at query.exception()
    assert not query.isActive, "the query did not finish within 240 s"
    return query


def sink_options(service: ServiceProcess, broker: RealKafka, sink: str, token: str, topic: str) -> dict[str, str]:
    """Spark's Kafka sink's options plus the coordinator's: the one-line switch."""
    return {"kafka.bootstrap.servers": broker.bootstrap, "topic": topic, "coordinator.url": service.url,
            "coordinator.token": token, "coordinator.sink": sink, "provenance.headers": "true"}


def test_the_sink_writes_every_batch_once_with_a_task_retried_after_its_precommit_and_an_empty_batch(
    spark: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    """Three batches; in batch 0 partition 1's first try fails after writing and returning its
    record (its retry writes again: two transactions of one partition, the driver commits the
    accepted one and the coordinator aborts the other); batch 1 is empty and asks nothing. Each
    task learned its attempt itself (begin and generation from the tasks, sparkclient/sink_runs.py)."""
    topic = real_kafka.create_topic(3)
    token = register(service, "native", real_kafka.bootstrap, topic)
    batches = [list(range(0, 30)), [], list(range(30, 75))]
    write_input_files(tmp_path / "in", batches)
    query = run_sink_query(spark, tmp_path / "in", tmp_path / "chk",
                           sink_options(service, real_kafka, "native", token, topic),
                           fault_hook=FailTask(frozenset({("after_precommit", 0, 1)})))
    assert query.exception() is None, query.exception()
    out = outcome(service, "native", real_kafka.bootstrap, topic)
    assert_exactly_once(out, [str(v) for b in batches for v in b], "native", real_kafka.bootstrap, topic)
    assert sorted(out.details) == [0, 2]  # the empty batch: no task had a row, nothing was asked
    with CoordinatorClient(service.url, ADMIN, "native") as c:
        assert c.describe_sink()["generation"] == 1  # every task of the run asked; one generation
    assert all(len(d["attempts"]) == 1 for d in out.details.values())  # every task got the same attempt
    retried = sorted(x["state"] for x in out.details[0]["leases"] if x["partition"] == 1)
    assert retried == ["ABORTED", "COMMITTED"], out.details[0]["leases"]
    assert {x["partition"] for x in out.details[2]["leases"] if x["state"] == "COMMITTED"} == {0, 1, 2}


def test_a_replayed_batch_writes_nothing_and_a_fresh_checkpoint_is_refused(
    spark: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    """After a run, Spark's commit log loses its last entry (the driver died between the
    coordinator's commit and Spark's commit log): the restarted query replays that batch over the
    same offsets; its tasks' begin answers skip, so nothing is written, no lease is taken, and the
    coordinator still holds one committed attempt. A query from a fresh checkpoint on the same sink
    is refused by the lineage check (Spark's query id is the sink's lineage)."""
    topic = real_kafka.create_topic(2)
    token = register(service, "replay", real_kafka.bootstrap, topic)
    batches = [list(range(0, 20)), list(range(20, 50))]
    write_input_files(tmp_path / "in", batches)
    options = sink_options(service, real_kafka, "replay", token, topic)
    query = run_sink_query(spark, tmp_path / "in", tmp_path / "chk", options, partitions=2)
    assert query.exception() is None, query.exception()
    before = read_topic(real_kafka.bootstrap, topic)
    with CoordinatorClient(service.url, ADMIN, "replay") as c:
        leases_before = c.checkpoint(1)["leases"]
    (tmp_path / "chk" / "commits" / "1").unlink()  # Spark never wrote batch 1's commit log entry
    for crc in (tmp_path / "chk" / "commits").glob(".1.crc"):
        crc.unlink()

    query = run_sink_query(spark, tmp_path / "in", tmp_path / "chk", options, partitions=2)
    assert query.exception() is None, query.exception()
    assert query.lastProgress is not None and query.lastProgress["batchId"] == 1  # batch 1 ran again
    assert len(read_topic(real_kafka.bootstrap, topic)) == len(before)  # not one record more, even aborted
    out = outcome(service, "replay", real_kafka.bootstrap, topic)
    assert_exactly_once(out, [str(v) for b in batches for v in b], "replay", real_kafka.bootstrap, topic)
    assert out.details[1]["leases"] == leases_before and len(out.details[1]["attempts"]) == 1
    with CoordinatorClient(service.url, ADMIN, "replay") as c:
        assert c.describe_sink()["generation"] == 2  # the restart was a new run

    shutil.rmtree(tmp_path / "fresh", ignore_errors=True)
    query = run_sink_query(spark, tmp_path / "in", tmp_path / "fresh", options, partitions=2)
    error = str(query.exception())
    assert "lineage_mismatch" in error and "lineage/reset" in error, error
    assert len(read_topic(real_kafka.bootstrap, topic)) == len(before)
