"""The exactly-once writer in real PySpark streaming queries (local mode) against the real
coordinator (uvicorn on Postgres, committing by EndTxn over the wire) and a real Kafka broker
(tests/fixtures/real_kafka.py). Exactly-once is what a read_committed consumer sees (tests/fixtures/spark_support.py),
cross-checked with the coordinator's records, the provenance headers and the broker's COMMIT markers.

Speculation: the session runs with spark.speculation=true, but Spark never launches a speculative
copy here: in local mode the scheduler does not start its speculation check at all, and in
`local-cluster[2,1,1024]` (tried: it starts here) every executor is on the same host, where Spark
does not place a copy of a task already running on that host (a probe with one 8 s straggler
among four tasks got no copy). Two attempts of one task that both write and pre-commit are
exercised instead by forcing a task attempt to fail AFTER its pre-commit: Spark's retry writes
and pre-commits the same partition again, the driver commits the attempt whose result Spark
accepted, and the coordinator aborts the other: the same situation a speculative copy creates.
"""

from __future__ import annotations

import time
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
    kafka_service,
    module_database_url,  # noqa: F401 - fixture
    service,  # noqa: F401 - fixture
    outcome,
    read_topic,
    register,
    spark_session,
    write_input_files,
)

from sparkclient import (
    BatchReport,
    CoordinatorClient,
    CoordinatorError,
    ExactlyOnceKafkaWriter,
    SchemaError,
    WriterOptionError,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("sparkclient-tests")
    yield session
    session.stop()


def options(service: ServiceProcess, broker: RealKafka, sink: str, token: str, topic: str, checkpoint: Path,
            **extra: str) -> dict[str, str]:
    return {
        "kafka.bootstrap.servers": broker.bootstrap, "topic": topic, "coordinator.url": service.url,
        "coordinator.token": token, "coordinator.sink": sink, "checkpointLocation": str(checkpoint),
        "provenance.headers": "true", **extra,
    }


def run_query(spark: Any, source: Path, checkpoint: Path, each_batch: Any) -> Any:
    """The file source, one file per micro-batch, until every file is processed."""
    from pyspark.sql import functions as F

    rows = spark.readStream.schema("n INT").option("maxFilesPerTrigger", 1).json(str(source))
    out = rows.select(F.col("n").cast("string").alias("key"), F.col("n").cast("string").alias("value"))
    query = (out.writeStream.foreachBatch(each_batch).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    from pyspark.errors import StreamingQueryException

    try:
        query.awaitTermination(240)
    except StreamingQueryException:
        pass  # the caller looks at query.exception()
    assert not query.isActive, "the query did not finish within 240 s"
    return query


def test_several_batches_with_retries_empty_batches_and_changing_partitions(
    spark: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    topic = real_kafka.create_topic(3)
    token = register(service, "orders", real_kafka.bootstrap, topic)
    batches = [list(range(0, 40)), [], list(range(40, 45)), list(range(45, 105)), list(range(105, 130))]
    write_input_files(tmp_path / "in", batches)
    # partitions per batch, set by repartition in foreachBatch: changes between batches, and 8
    # partitions for 5 rows leaves empty partitions
    partitions = {0: 3, 2: 8, 3: 2, 4: 4}
    faults = FailTask(frozenset({
        ("after_lease", 0, 1),  # fails before writing: the retry takes a new lease
        ("after_precommit", 3, 0),  # fails after pre-committing: two pre-committed attempts of one task
        ("after_precommit", 3, 1),
        ("before_precommit", 4, 2),  # fails with an open, flushed transaction
    }))
    reports: list[BatchReport] = []
    writer = ExactlyOnceKafkaWriter(options(service, real_kafka, "orders", token, topic, tmp_path / "chk",
                                            **{"max.write.tasks": "0"}),  # each batch keeps its partitions
                                    on_batch=reports.append, fault_hook=faults)

    def each_batch(df: Any, batch_id: int) -> None:
        writer(df.repartition(partitions[batch_id]) if batch_id in partitions else df, batch_id)

    query = run_query(spark, tmp_path / "in", tmp_path / "chk", each_batch)
    assert query.exception() is None, query.exception()

    assert [(r.batch_id, r.action, r.records) for r in reports] == [
        (0, "committed", 40), (1, "empty", 0), (2, "committed", 5), (3, "committed", 60), (4, "committed", 25)]
    assert [r.partitions for r in reports if r.batch_id != 1] == [3, 8, 2, 4]
    out = outcome(service, "orders", real_kafka.bootstrap, topic)
    assert_exactly_once(out, [str(v) for b in batches for v in b], "orders", real_kafka.bootstrap, topic)

    # each batch committed at its first attempt, one generation, winners = accepted task attempts;
    # the empty batch was begun and committed without a lease or a transaction (no Spark job checks
    # emptiness first)
    assert sorted(out.details) == [0, 1, 2, 3, 4] and out.details[1]["leases"] == []
    assert all(d["checkpoint"]["committed_attempt"] == 1 for d in out.details.values())
    for batch in (0, 2, 3, 4):  # the driver committed exactly the task results Spark accepted
        committed = {x["partition"]: x["lease_id"] for x in out.details[batch]["leases"] if x["state"] == "COMMITTED"}
        assert reports[batch].winners == {p: committed.get(p) for p in range(partitions[batch])}
    assert list(reports[2].winners.values()).count(None) >= 3  # 5 rows in 8 partitions: empty ones, no lease
    # the retried tasks: their first attempts' leases lost and ended aborted
    lost = {(x["partition"], x["state"], x["records"]) for x in out.details[3]["leases"] if x["state"] != "COMMITTED"}
    assert {p for p, _, _ in lost} == {0, 1} and all(state == "ABORTED" for _, state, _ in lost), lost
    # their records never reached the coordinator: a task returns its record to the driver, and only
    # the results Spark accepted travel with the commit
    assert all(records is None for _, _, records in lost)
    losing_records = [r for r in out.records if int(r.headers["eos-lease-id"]) in out.losers]
    assert len(losing_records) >= 60  # the aborted copies are in the log; read_committed never showed them
    assert [x["state"] for x in out.details[0]["leases"] if x["partition"] == 1].count("ABORTED") == 1
    assert [x["state"] for x in out.details[4]["leases"] if x["partition"] == 2].count("ABORTED") == 1
    # per-batch figures for operators
    for d in out.details.values():
        assert d["attempts"][0]["job_ms"] is not None and d["attempts"][0]["job_ms"] >= 0
    assert all(x["write_ms"] is not None and x["records"] > 0 for x in out.winners.values())

    # a query restarted from a fresh checkpoint location against the same sink is refused
    fresh = ExactlyOnceKafkaWriter(options(service, real_kafka, "orders", token, topic, tmp_path / "fresh"))
    query = run_query(spark, tmp_path / "in", tmp_path / "fresh", fresh)
    error = str(query.exception())
    assert "lineage_mismatch" in error and "fresh checkpoint location" in error and "lineage/reset" in error, error
    with CoordinatorClient(service.url, ADMIN, "orders") as c:
        assert len(c.checkpoints()) == 5  # nothing was written for the refused query


def test_the_same_checkpoint_continues_and_skips_what_was_committed(
    spark: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    """A commit the coordinator refuses stops the query; restarted from the same checkpoint
    location, the batch is replayed under a new generation and commits; a batch already committed
    is skipped."""
    topic = real_kafka.create_topic(2)
    token = register(service, "views", real_kafka.bootstrap, topic)
    batches = [list(range(0, 10)), list(range(10, 30))]
    write_input_files(tmp_path / "in", batches)
    opts = options(service, real_kafka, "views", token, topic, tmp_path / "chk")

    class RefuseOnce:
        """Stands in for a refused commit: an abort from an operator between job and commit."""

        def __init__(self, url: str) -> None:
            self.url = url  # (shipped to executors with the task closure: only plain values)
            self.done = False

        def __call__(self, step: str, **info: Any) -> None:
            if step == "before_commit" and info["batch_id"] == 1 and not self.done:
                self.done = True
                with CoordinatorClient(self.url, ADMIN, "views") as admin:
                    admin.request("POST", f"/v1/sinks/views/checkpoints/1/attempts/{info['attempt']}/abort",
                                  {"reason": "operator abort in test"})

    first = ExactlyOnceKafkaWriter(opts, fault_hook=RefuseOnce(service.url))
    query = run_query(spark, tmp_path / "in", tmp_path / "chk", first)
    error = query.exception()
    assert error is not None and "attempt_aborted" in str(error), error

    reports: list[BatchReport] = []
    again = ExactlyOnceKafkaWriter(opts, on_batch=reports.append)
    query = run_query(spark, tmp_path / "in", tmp_path / "chk", again)
    assert query.exception() is None, query.exception()
    assert [(r.batch_id, r.action, r.attempt, r.records) for r in reports] == [(1, "committed", 2, 20)]
    out = outcome(service, "views", real_kafka.bootstrap, topic)
    assert_exactly_once(out, [str(v) for b in batches for v in b], "views", real_kafka.bootstrap, topic)
    assert [a["state"] for a in out.details[1]["attempts"]] == ["ABORTED", "COMMITTED"]

    # a batch committed but not in Spark's commit log (the driver died in between) is skipped
    reports.clear()
    replay = ExactlyOnceKafkaWriter(opts, on_batch=reports.append)
    df = spark.createDataFrame([("x", "x")], "key string, value string")
    replay(df, 1)
    assert [(r.batch_id, r.action, r.records) for r in reports] == [(1, "skipped", 0)]
    assert len(read_topic(real_kafka.bootstrap, topic)) == len(out.records)  # nothing more was written


def test_wrong_or_missing_columns_fail_before_anything_is_written(
    spark: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path
) -> None:
    topic = real_kafka.create_topic(1)
    token = register(service, "typed", real_kafka.bootstrap, topic)
    (tmp_path / "chk").mkdir()
    writer = ExactlyOnceKafkaWriter(options(service, real_kafka, "typed", token, topic, tmp_path / "chk"))
    cases = [
        (spark.createDataFrame([(1,)], "value int"), "column 'value' has type int; expected string or binary"),
        (spark.createDataFrame([("k",)], "key string"), "no 'value' column"),
        (spark.createDataFrame([("v", 1)], "value string, key bigint"), "column 'key' has type bigint"),
        (spark.createDataFrame([("v", "p")], "value string, partition string"), "column 'partition' has type string; expected int"),
        (spark.createDataFrame([("v", [("h", "x")])], "value string, headers array<struct<key:string,value:string>>"),
         "column 'headers' has type array<struct<key:string,value:string>>; expected array<struct<key: string, value: binary>>"),
        (spark.createDataFrame([("a", "b")], "value string, v2 string").toDF("value", "value"),
         "more than one column named ['value']"),
    ]
    for df, message in cases:
        with pytest.raises(SchemaError, match=message.replace("(", r"\(").replace("[", r"\[")):
            writer(df, 0)
    no_topic = ExactlyOnceKafkaWriter({**options(service, real_kafka, "typed", token, topic, tmp_path / "chk"), "topic": ""})
    with pytest.raises(SchemaError, match="no topic"):
        no_topic(spark.createDataFrame([("v",)], "value string"), 0)
    with CoordinatorClient(service.url, ADMIN, "typed") as c:
        assert c.checkpoints() == [] and c.describe_sink()["generation"] == 0  # the coordinator never heard of it
    assert read_topic(real_kafka.bootstrap, topic) == []


def test_options_are_checked_with_messages_that_say_what_to_fix(service: ServiceProcess, tmp_path: Path) -> None:
    base = {"kafka.bootstrap.servers": "k:9092", "topic": "t", "coordinator.url": service.url,
            "coordinator.token": "x", "coordinator.sink": "s", "checkpointLocation": str(tmp_path)}
    for missing in ("kafka.bootstrap.servers", "coordinator.url", "coordinator.token", "coordinator.sink",
                    "checkpointLocation"):
        with pytest.raises(WriterOptionError, match=f"option '{missing}' is required"):
            ExactlyOnceKafkaWriter({k: v for k, v in base.items() if k != missing})
    with pytest.raises(WriterOptionError, match="kafka.transactional.id.*leases one per task attempt"):
        ExactlyOnceKafkaWriter({**base, "kafka.transactional.id": "mine"})
    with pytest.raises(WriterOptionError, match="kafka.acks.*must be 'all'"):
        ExactlyOnceKafkaWriter({**base, "kafka.acks": "1"})
    with pytest.raises(WriterOptionError, match=r"unknown option\(s\) \['kafka_bootstrap'\]"):
        ExactlyOnceKafkaWriter({**base, "kafka_bootstrap": "x"})
    writer = ExactlyOnceKafkaWriter({**base, "kafka.linger.ms": "50", "kafka.security.protocol": "SSL"})
    assert writer.options.producer_config["linger.ms"] == "50"
    assert writer.options.producer_config["security.protocol"] == "SSL"


def test_the_client_retries_until_the_coordinator_answers_and_explains_refusals(
    module_database_url: str, tmp_path: Path  # noqa: F811 - the fixture imported above
) -> None:
    """Connection refused (the service is not up yet) is retried with backoff until it answers;
    a 4xx is not retried and says what to do; an unreachable service fails within the budget."""
    import threading

    late = kafka_service(module_database_url, tmp_path, COORDINATOR_RECOVERY_ENABLED="false")
    client = CoordinatorClient(late.url, ADMIN, "late", retry_budget_s=60, backoff_max_s=0.5)
    answer: list[Any] = []
    caller = threading.Thread(target=lambda: answer.append(client.register_sink("late-tx", "k:9092", ["t"],
                                                                               check_broker=False)))
    caller.start()
    try:
        time.sleep(1.0)  # the call is failing (connection refused) and retrying now
        assert not answer
        late.start().wait_ready()
        caller.join(60)
        assert answer and answer[0]["sink"]["name"] == "late"
        with CoordinatorClient(late.url, "wrong-token", "late") as wrong, pytest.raises(CoordinatorError) as refused:
            wrong.begin(0, 1)
        assert refused.value.status == 403 and "writer token" in str(refused.value)
        with CoordinatorClient(late.url, ADMIN, "late") as admin, pytest.raises(CoordinatorError) as stale:
            admin.begin(0, 7)
        assert stale.value.status == 409 and stale.value.reason == "unknown_generation"
    finally:
        client.close()
        if late.alive:
            late.stop()
    with CoordinatorClient(late.url, ADMIN, "late", retry_budget_s=1.0, backoff_max_s=0.2) as gone, \
            pytest.raises(CoordinatorError, match="no answer after .* tries .*check that the coordinator"):
        gone.describe_sink()


def test_every_kafka_sink_column_is_written_as_spark_gives_it(
    spark: Any, service: ServiceProcess, real_kafka: RealKafka, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """All five columns of Spark's Kafka-sink schema through the Arrow path, a null `value` (a
    tombstone), a null header value, the `partition` column and the `topic` column (no topic
    option), as a read_committed consumer reads them; the batch's six partitions are written by as
    many tasks as the context has slots. Called outside a streaming query, the batch has no offsets
    entry: it fails loudly before `begin`, unless offsets.binding=off (warned once)."""
    import logging

    from sparkclient.checkpoint_files import OffsetsUnavailable

    topic = real_kafka.create_topic(3)
    token = register(service, "columns", real_kafka.bootstrap, topic)
    (tmp_path / "chk").mkdir()
    (tmp_path / "chk" / "metadata").write_text('{"id":"query-columns"}\n')
    opts = {**options(service, real_kafka, "columns", token, topic, tmp_path / "chk"), "topic": "",
            "provenance.headers": "false"}
    rows = [(b"k0", b"v0", topic, 0, [])]
    df = spark.createDataFrame(rows, "key binary, value binary, topic string, partition int, "
                                     "headers array<struct<key: string, value: binary>>")
    with pytest.raises(OffsetsUnavailable, match=r"offsets/0: .*set option offsets.binding=off"):
        ExactlyOnceKafkaWriter(opts)(df, 0)
    with CoordinatorClient(service.url, ADMIN, "columns") as c:
        assert c.checkpoints() == []  # refused before begin
    writer = ExactlyOnceKafkaWriter({**opts, "offsets.binding": "off"})
    rows = [(f"k{i}".encode(), None if i == 3 else f"v{i}".encode(), topic, i % 3,
             [("trace", f"t{i}".encode()), ("empty", None)]) for i in range(6)]
    df = spark.createDataFrame(
        rows, "key binary, value binary, topic string, partition int, "
              "headers array<struct<key: string, value: binary>>").repartition(6)
    reports: list[BatchReport] = []
    writer.on_batch = reports.append
    with caplog.at_level(logging.WARNING, logger="sparkclient.checkpoint_files"):
        writer(df, 0)
    # 6 partitions, 2 task slots (local[2,4]): written by 2 tasks, 2 transactions (max.write.tasks)
    assert [(r.action, r.records, r.partitions) for r in reports] == [("committed", 6, 2)]
    assert [r.message for r in caplog.records].count(
        "option offsets.binding=off: batches are not bound to the offsets Spark planned for them, so a replay over "
        "other offsets (a checkpoint restored from a backup) is not refused") == 1
    got = sorted(read_topic(real_kafka.bootstrap, topic, committed=True), key=lambda r: r.key)
    assert [(r.key, r.value, r.partition, r.headers) for r in got] == [
        (f"k{i}".encode(), None if i == 3 else f"v{i}".encode(), i % 3, {"trace": f"t{i}"}) for i in range(6)]


def test_the_driver_refuses_coordinator_answers_it_does_not_expect(spark: Any, tmp_path: Path) -> None:
    """A begin answer that is neither write nor skip (another coordinator version, a broken proxy)
    must not be taken for a write; a COMMITTED answer naming other winners than the driver's must
    not let the batch pass as committed. A scripted HTTP server stands in for the coordinator."""
    import json

    from fixtures.servers import scripted_http

    (tmp_path / "metadata").write_text('{"id":"query-odd"}\n')
    sink = (200, json.dumps({"name": "odd", "transaction_timeout_ms": 60000}), {})
    generation = (200, json.dumps({"generation": 3, "aborted": [], "abort_pending": []}), {})
    empty = spark.createDataFrame([], "value string")
    with scripted_http() as (url, script):
        opts = {"kafka.bootstrap.servers": "127.0.0.1:1", "topic": "t", "coordinator.url": url,
                "coordinator.token": "w", "coordinator.sink": "odd", "checkpointLocation": str(tmp_path),
                "offsets.binding": "off"}
        script.answers = [sink, generation, (200, json.dumps({"action": "wait", "batch_id": 0, "state": "OPEN",
                                                             "attempt": None, "resumed": False}), {})]
        with pytest.raises(CoordinatorError, match="begin of batch 0 answered action 'wait'"):
            ExactlyOnceKafkaWriter(opts)(empty, 0)
        assert script.requests[-1] == "POST /v1/sinks/odd/checkpoints/0/begin"  # nothing after it

        script.requests.clear()
        begin = (200, json.dumps({"action": "write", "batch_id": 0, "state": "OPEN", "attempt": 1,
                                  "resumed": False, "aborted": [], "abort_pending": []}), {})
        other_winner = {"partition": 0, "lease_id": 99, "transactional_id": "x-0", "producer_id": 1,
                        "producer_epoch": 0, "records": 5, "bytes": 5}
        committed = (200, json.dumps({"batch_id": 0, "state": "COMMITTED", "attempt": 1, "committed": [other_winner],
                                      "aborted": [], "abort_pending": [], "warnings": []}), {})
        script.answers = [sink, generation, begin, committed]
        reports: list[BatchReport] = []
        with pytest.raises(CoordinatorError, match="commit of batch 0 answered winners .*99.* the driver named"):
            ExactlyOnceKafkaWriter(opts, on_batch=reports.append)(empty, 0)
        assert script.requests[-1] == "POST /v1/sinks/odd/checkpoints/0/attempts/1/commit" and reports == []
