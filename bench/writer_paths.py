"""The writer benchmark's parts: its processes (a Kafka broker, `coordinator serve`), the input data,
and the three ways a streaming query writes it to Kafka, each as a user writes it:

  spark-kafka-sink  `.writeStream.format("kafka")`: Spark's own sink (at-least-once; Kafka's Java
                    producer, idempotent with acks=all, pooled per executor);
  native-sink       `.writeStream.format("kafka_eos")` (sparkclient/sink.py): the same query with
                    the one-line switch and the coordinator's options;
  foreach-batch     `.writeStream.foreachBatch(ExactlyOnceKafkaWriter({...}))` (sparkclient/writer.py),
                    which writes a batch with at most as many tasks as the context has slots;
  foreach-batch-per-partition  the same with `max.write.tasks=0`: one task (transaction) per
                    partition, as Spark's sink and the native sink write.

Every path gets the writer's producer settings (linger.ms=20, batch.size=1000000) and the same
plan: the file source (one parquet file per micro-batch), `repartition(P)`, key and value columns.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from sparkclient import CoordinatorClient, ExactlyOnceKafkaWriter  # noqa: E402
from sparkclient.options import PRODUCER_DEFAULTS  # noqa: E402

SPARK_SINK, NATIVE, FOREACH = "spark-kafka-sink", "native-sink", "foreach-batch"
FOREACH_PER_PARTITION = "foreach-batch-per-partition"
PATHS = (SPARK_SINK, NATIVE, FOREACH, FOREACH_PER_PARTITION)
EXACTLY_ONCE = (NATIVE, FOREACH, FOREACH_PER_PARTITION)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout_s} s")


def start_kafka(workdir: Path) -> tuple[Any, str]:
    """A single-node Apache Kafka (localkafka/: Kafka's own jars via Maven), stopped by `.stop()`."""
    from localkafka import LocalKafka

    cluster = LocalKafka(workdir / "kafka").start()
    return cluster, cluster.bootstrap_servers


def start_coordinator(workdir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
    env.update(COORDINATOR_DATA_DIR=str(workdir / "coordinator"), COORDINATOR_PORT=str(port),
               COORDINATOR_KAFKA_CONTROL_PLANE="kafka", COORDINATOR_LOG_LEVEL="warning")
    log = open(workdir / "coordinator.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve"], cwd=REPO_ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz", proc)
    return proc, url, (workdir / "coordinator" / "admin-token").read_text().strip()


def stop_all(procs: list[Any]) -> None:
    for proc in reversed(procs):
        if not isinstance(proc, subprocess.Popen):
            proc.stop()
            continue
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def create_topic(bootstrap: str, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})  # kept alive until the answer
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    return name


def visible_records(bootstrap: str, topic: str) -> int:
    """Records a read_committed consumer reads from the topic, to its end (not timed)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"count-{uuid.uuid4().hex[:8]}",
                         "isolation.level": "read_committed", "enable.auto.commit": False, "log_level": 0})
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        count, deadline = 0, time.monotonic() + 300
        while time.monotonic() < deadline:
            count += sum(m.error() is None for m in consumer.consume(10_000, timeout=1))
            done = consumer.position([TopicPartition(topic, p) for p in parts])
            if all(tp.offset >= ends[tp.partition] or ends[tp.partition] == 0 for tp in done):
                return count
        raise SystemExit(f"{topic}: not read to its end within 300 s ({count} records so far)")
    finally:
        consumer.close()


def register(url: str, admin_token: str, bootstrap: str, topic: str, prefix: str) -> tuple[str, str]:
    sink = f"{prefix}-{uuid.uuid4().hex[:6]}"
    with CoordinatorClient(url, admin_token, sink) as admin:
        token = admin.register_sink(f"{sink}-tx", bootstrap, [topic], transaction_timeout_ms=300_000)["writer_token"]
    return sink, token


def spark_session(master: str, shuffle_partitions: int) -> Any:
    """One session for every path, with Spark's Kafka connector and the setting the docs ask for
    (`spark.python.unix.domain.socket.enabled`: no loopback-TCP stall per Python task)."""
    from pyspark.sql import SparkSession

    from localkafka import spark_kafka_jars

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(master).appName("writer-bench").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
             .config("spark.jars", ",".join(spark_kafka_jars()))
             .config("spark.python.unix.domain.socket.enabled", "true")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_data(spark: Any, directory: Path, batches: int, records: int, value_bytes: int) -> None:
    """One parquet file per micro-batch, in modification-time order; keys are the record's number,
    values ~value_bytes long."""
    from pyspark.sql import functions as F

    filler = "x" * max(0, value_bytes - 12)
    for b in range(batches):
        first = b * records
        df = spark.range(first, first + records, numPartitions=1).select(
            F.col("id").cast("string").alias("key"),
            F.concat(F.lpad(F.col("id").cast("string"), 12, "0"), F.lit(filler)).alias("value"))
        df.write.mode("append").parquet(str(directory))
        time.sleep(0.01)


def start_query(spark: Any, path: str, source: Path, checkpoint: Path, partitions: int, bootstrap: str, topic: str,
                coordinator: tuple[str, str, str] | None, writer_options: dict[str, str]) -> Any:
    """The query of one path over `source` (availableNow: every file, one per batch, then it ends)."""
    rows = (spark.readStream.schema("key string, value string").option("maxFilesPerTrigger", 1)
            .parquet(str(source)).repartition(partitions))
    kafka = {"kafka.bootstrap.servers": bootstrap, "topic": topic}
    if path == SPARK_SINK:
        stream = rows.writeStream.format("kafka").options(**kafka).options(**{
            "kafka.acks": "all", "kafka.enable.idempotence": "true",
            "kafka.linger.ms": str(PRODUCER_DEFAULTS["linger.ms"]),
            "kafka.batch.size": str(PRODUCER_DEFAULTS["batch.size"])})
    else:
        assert coordinator is not None
        url, sink, token = coordinator
        options = {**kafka, "coordinator.url": url, "coordinator.token": token, "coordinator.sink": sink,
                   **writer_options}
        if path == NATIVE:
            from sparkclient.sink import register_sink

            stream = rows.writeStream.format(register_sink(spark)).options(**options)
        else:
            per_partition = {"max.write.tasks": "0"} if path == FOREACH_PER_PARTITION else {}
            stream = rows.writeStream.foreachBatch(
                ExactlyOnceKafkaWriter({**options, "checkpointLocation": str(checkpoint), **per_partition}))
    return stream.option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()


def run_query(query: Any) -> float:
    """Wait for the query to end; its wall time from now."""
    started = time.monotonic()
    query.awaitTermination()
    if query.exception() is not None:
        raise SystemExit(f"query failed: {query.exception()}")
    return time.monotonic() - started


def batch_wall_times(query: Any) -> list[float]:
    """Seconds per micro-batch (Spark's triggerExecution: planning, the write, the commit, Spark's
    logs), from the query's progress reports."""
    return [p["durationMs"]["triggerExecution"] / 1000 for p in query.recentProgress if p["numInputRows"] > 0]
