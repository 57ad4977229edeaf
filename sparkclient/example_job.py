"""Runnable example: Spark's `rate` source -> a transformation -> the exactly-once writer.

    python -m sparkclient.example_job        # configured by environment variables (or the flags)

| variable | default | meaning |
| --- | --- | --- |
| `KAFKA_BOOTSTRAP_SERVERS` | required | the Kafka cluster |
| `OUTPUT_TOPIC` | `exactly-once-demo` | created (3 partitions, `OUTPUT_TOPIC_PARTITIONS`) if missing |
| `COORDINATOR_URL` | required | the coordinator |
| `COORDINATOR_ADMIN_TOKEN` | | if set, the job registers the sink when missing (idempotent) and uses its writer token |
| `COORDINATOR_WRITER_TOKEN` | | the sink's writer token (when no admin token is given) |
| `SINK_NAME` | `demo` | |
| `TRANSACTIONAL_ID_PREFIX` | `demo-` | used when registering the sink |
| `TRANSACTION_TIMEOUT_MS` | `60000` | used when registering the sink |
| `CHECKPOINT_LOCATION` | `/tmp/exactly-once-demo-checkpoint` | restart with the same one to continue |
| `SPARK_MASTER` | `local[2]` | |
| `ROWS_PER_SECOND` | `100` | the rate source's speed |
| `TOTAL_RECORDS` | `0` (forever) | keep rows with value < TOTAL_RECORDS; exit 0 once the batch holding TOTAL_RECORDS-1 is committed |

Every record has key = value = the rate row's `value` as a decimal string and the provenance
headers (eos-sink, eos-batch-id, eos-attempt, eos-lease-id). With TOTAL_RECORDS set, the committed
(read_committed) output is exactly "0" .. "TOTAL_RECORDS-1", each once, whatever was killed when.
One log line per batch: batch id, action, records, durations.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from typing import Any

from .client import CoordinatorClient, CoordinatorError
from .writer import BatchReport, ExactlyOnceKafkaWriter

log = logging.getLogger("sparkclient.example_job")

SETTINGS = [  # (flag / env name, default, help)
    ("KAFKA_BOOTSTRAP_SERVERS", None, "Kafka bootstrap servers (required)"),
    ("OUTPUT_TOPIC", "exactly-once-demo", "output topic"),
    ("OUTPUT_TOPIC_PARTITIONS", "3", "partitions when the job creates the topic"),
    ("COORDINATOR_URL", None, "coordinator base URL (required)"),
    ("COORDINATOR_ADMIN_TOKEN", None, "admin token: register the sink if missing"),
    ("COORDINATOR_WRITER_TOKEN", None, "the sink's writer token"),
    ("SINK_NAME", "demo", "sink name"),
    ("TRANSACTIONAL_ID_PREFIX", "demo-", "transactional id prefix (sink registration)"),
    ("TRANSACTION_TIMEOUT_MS", "60000", "transaction timeout (sink registration)"),
    ("CHECKPOINT_LOCATION", "/tmp/exactly-once-demo-checkpoint", "Spark checkpoint location"),
    ("SPARK_MASTER", "local[2]", "Spark master"),
    ("ROWS_PER_SECOND", "100", "rate source rows per second"),
    ("TOTAL_RECORDS", "0", "stop after values 0..N-1 are committed (0: run forever)"),
]


def settings(argv: list[str] | None = None) -> dict[str, str | None]:
    parser = argparse.ArgumentParser(prog="python -m sparkclient.example_job", description=__doc__.split("\n")[0])
    for name, default, text in SETTINGS:
        parser.add_argument("--" + name.lower().replace("_", "-"), dest=name, default=os.environ.get(name, default),
                            help=f"{text} (env {name}, default {default})")
    args = vars(parser.parse_args(argv))
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "COORDINATOR_URL"):
        if not args[name]:
            parser.error(f"{name} is required (environment variable or --{name.lower().replace('_', '-')})")
    if not args["COORDINATOR_ADMIN_TOKEN"] and not args["COORDINATOR_WRITER_TOKEN"]:
        parser.error("set COORDINATOR_ADMIN_TOKEN (registers the sink) or COORDINATOR_WRITER_TOKEN")
    return args


def ensure_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic in admin.list_topics(timeout=30).topics:
        return
    try:
        admin.create_topics([NewTopic(topic, partitions)])[topic].result(30)
        log.info("created topic %s with %d partitions", topic, partitions)
    except KafkaException as exc:
        if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
            raise


def writer_token(s: dict[str, Any]) -> str:
    if not s["COORDINATOR_ADMIN_TOKEN"]:
        return str(s["COORDINATOR_WRITER_TOKEN"])
    with CoordinatorClient(s["COORDINATOR_URL"], s["COORDINATOR_ADMIN_TOKEN"], s["SINK_NAME"]) as admin:
        registered = admin.register_sink(s["TRANSACTIONAL_ID_PREFIX"], s["KAFKA_BOOTSTRAP_SERVERS"],
                                         [s["OUTPUT_TOPIC"]], int(s["TRANSACTION_TIMEOUT_MS"]))
    return str(registered["writer_token"])


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    s = settings(argv)
    total = int(s["TOTAL_RECORDS"] or 0)
    ensure_topic(s["KAFKA_BOOTSTRAP_SERVERS"], s["OUTPUT_TOPIC"], int(s["OUTPUT_TOPIC_PARTITIONS"]))
    try:
        token = writer_token(s)
    except CoordinatorError as exc:
        log.error("%s", exc)
        return 2

    from pyspark.sql import SparkSession
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import functions as F

    # executors' Python workers need this package and confluent-kafka: in local mode, use this interpreter
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(s["SPARK_MASTER"]).appName("exactly-once-demo")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    done = threading.Event()

    def on_batch(report: BatchReport) -> None:
        print(f"[example_job] {report.line()}", flush=True)

    writer = ExactlyOnceKafkaWriter({
        "kafka.bootstrap.servers": s["KAFKA_BOOTSTRAP_SERVERS"],
        "topic": s["OUTPUT_TOPIC"],
        "coordinator.url": s["COORDINATOR_URL"],
        "coordinator.token": token,
        "coordinator.sink": s["SINK_NAME"],
        "checkpointLocation": s["CHECKPOINT_LOCATION"],
        "provenance.headers": "true",
    }, on_batch=on_batch)

    def write_batch(df: Any, batch_id: int) -> None:
        writer(df, batch_id)  # raises if the batch could not be committed: the query stops
        if total and df.filter(F.col("value") == str(total - 1)).limit(1).count():
            done.set()  # the batch holding the last value is committed (or was, before a restart)

    rows = spark.readStream.format("rate").option("rowsPerSecond", int(s["ROWS_PER_SECOND"])).load()
    if total:
        rows = rows.filter(F.col("value") < total)
    out = rows.select(F.col("value").cast("string").alias("key"), F.col("value").cast("string").alias("value"))
    query = (out.writeStream.foreachBatch(write_batch).option("checkpointLocation", s["CHECKPOINT_LOCATION"])
             .trigger(processingTime="1 second").start())
    print(f"[example_job] query {query.id} run {query.runId} writing to {s['OUTPUT_TOPIC']} through sink "
          f"{s['SINK_NAME']}", flush=True)
    try:
        while not done.is_set():
            if query.awaitTermination(0.5):
                break  # stopped from outside
    except StreamingQueryException as exc:
        print(f"[example_job] the query failed: {exc}", file=sys.stderr, flush=True)
        return 1
    else:
        if not done.is_set():
            print("[example_job] the query stopped before all records were committed", file=sys.stderr, flush=True)
            return 1
        for _ in range(100):  # stop between triggers, not in the middle of the next batch
            if not query.status["isTriggerActive"]:
                break
            time.sleep(0.05)
        query.stop()  # before the last line: a trigger may have started since, and may log its batch
        print(f"[example_job] all {total} records committed", flush=True)
        return 0
    finally:
        if query.isActive:
            query.stop()
        writer.close()
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
