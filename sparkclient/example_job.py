"""Runnable example: a Kafka topic -> Spark's own Kafka source (read_committed) -> the exactly-once writer -> a Kafka topic.

    python -m sparkclient.example_job        # configured by environment variables or the flags below

| variable (flag) | default | meaning |
| --- | --- | --- |
| `KAFKA_BOOTSTRAP_SERVERS` | required | the Kafka cluster (input and output) |
| `INPUT_TOPIC` | `exactly-once-demo-in` | read with `kafka.isolation.level=read_committed` from the earliest offset; created if missing |
| `INPUT_RECORDS` | `0` | first make the input topic hold records "0".."N-1" (key = value; appends the missing ones, so a re-run or restart adds none); `TOTAL_RECORDS` is an older name |
| `OUTPUT_TOPIC` | `exactly-once-demo-out` | created (`TOPIC_PARTITIONS`) if missing |
| `TOPIC_PARTITIONS` | `3` | partitions of a topic the job creates (`OUTPUT_TOPIC_PARTITIONS` is an older name) |
| `COORDINATOR_URL` | required | the coordinator |
| `COORDINATOR_ADMIN_TOKEN` | | if set, the job registers the sink when missing (idempotent) and uses its writer token |
| `COORDINATOR_WRITER_TOKEN` | | the sink's writer token (when no admin token is given) |
| `CHECKPOINT_LOCATION` | a fresh directory per run | `<tmp>/exactly-once-demo/demo-<UTC time>`; give a used one to continue that query |
| `SINK_NAME` | from the checkpoint | the checkpoint directory's name (`demo-<UTC time>`; `demo-` put before a name without it) |
| `TRANSACTIONAL_ID_PREFIX` | the sink name | used when registering the sink |
| `TRANSACTION_TIMEOUT_MS` | `60000` | used when registering the sink |
| `TRIGGER` | `availableNow` | `availableNow`: process what the input holds, then exit; or a processingTime interval (`1 second`): run until Ctrl-C, or with `INPUT_RECORDS` until the input is caught up |
| `MAX_RECORDS_PER_BATCH` | `0` (no limit) | the Kafka source's `maxOffsetsPerTrigger` (more, smaller batches) |
| `KAFKA_POLL_TIMEOUT_MS` | `10000` | the Kafka source's `kafkaConsumer.pollTimeoutMs`: a batch whose offsets hold only aborted records waits this long (Spark's default 120 s) |
| `KAFKA_WAIT_S` | `60` | how long to wait at start for Kafka to answer; then the job exits with status 2 and says what to do |
| `ROWS_PER_SECOND` | | an older pacing: N records a second (`TRIGGER=1 second`, `MAX_RECORDS_PER_BATCH=N`) unless those are set |
| `SPARK_MASTER` | `local[2]` | |
| `SPARK_JARS` | resolved by Maven | Spark's Kafka connector jars, comma-separated (default: `python -m localkafka classpath spark`) |

A checkpoint location is one query, and one sink (a sink is bound to the query that first wrote it:
a fresh checkpoint with a used sink is refused by the coordinator's lineage check). So by default
every run is a new query with a new checkpoint and sink that reads the input from its beginning; the
first line names the checkpoint, and `--checkpoint-location` with it continues that query where it
stopped: a run whose checkpoint has nothing new to read says so and exits 0.

Every output record has the input record's key and value and the provenance headers (eos-sink,
eos-batch-id, eos-attempt, eos-lease-id). The Spark session talks to its Python workers over Unix
domain sockets (`spark.python.unix.domain.socket.enabled=true`, docs/spark.md#small-batches). One
line per batch (id, action, records, durations);
the last line sums the run up. Exit codes: 0 done (or stopped with Ctrl-C), 1 the query failed,
2 bad settings or the coordinator refused the sink.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .client import CoordinatorClient, CoordinatorError
from .session_settings import RECOMMENDED_CONF
from .writer import BatchReport, ExactlyOnceKafkaWriter

log = logging.getLogger("sparkclient.example_job")

SETTINGS = [  # (flag / env name, default, help)
    ("KAFKA_BOOTSTRAP_SERVERS", None, "Kafka bootstrap servers (required)"),
    ("INPUT_TOPIC", "exactly-once-demo-in", "input topic (read_committed, from the earliest offset)"),
    ("INPUT_RECORDS", "0", "first make the input topic hold records 0..N-1 (appends the missing ones)"),
    ("OUTPUT_TOPIC", "exactly-once-demo-out", "output topic"),
    ("TOPIC_PARTITIONS", "3", "partitions of a topic the job creates"),
    ("COORDINATOR_URL", None, "coordinator base URL (required)"),
    ("COORDINATOR_ADMIN_TOKEN", None, "admin token: register the sink if missing"),
    ("COORDINATOR_WRITER_TOKEN", None, "the sink's writer token"),
    ("CHECKPOINT_LOCATION", None, "Spark checkpoint location (default: a fresh one per run)"),
    ("SINK_NAME", None, "sink name (default: the checkpoint directory's name)"),
    ("TRANSACTIONAL_ID_PREFIX", None, "transactional id prefix (sink registration; default: the sink name)"),
    ("TRANSACTION_TIMEOUT_MS", "60000", "transaction timeout (sink registration)"),
    ("TRIGGER", "availableNow", "availableNow, or a processingTime interval such as '1 second'"),
    ("MAX_RECORDS_PER_BATCH", "0", "the Kafka source's maxOffsetsPerTrigger (0: no limit)"),
    ("KAFKA_POLL_TIMEOUT_MS", "10000", "the Kafka source's kafkaConsumer.pollTimeoutMs"),
    ("KAFKA_WAIT_S", "60", "how long to wait for Kafka to answer at start"),
    ("SPARK_MASTER", "local[2]", "Spark master"),
    ("SPARK_JARS", None, "Spark's Kafka connector jars, comma-separated (default: resolved by Maven)"),
]


def say(text: str, *, error: bool = False) -> None:
    print(f"[example_job] {text}", file=sys.stderr if error else sys.stdout, flush=True)


def settings(argv: list[str] | None = None) -> dict[str, str | None]:
    parser = argparse.ArgumentParser(prog="python -m sparkclient.example_job", description=__doc__.split("\n")[0])
    for name, default, text in SETTINGS:
        parser.add_argument("--" + name.lower().replace("_", "-"), dest=name, default=os.environ.get(name, default),
                            help=f"{text} (env {name})")
    args = vars(parser.parse_args(argv))
    if args["INPUT_RECORDS"] == "0" and os.environ.get("TOTAL_RECORDS"):  # the names docker-compose uses
        args["INPUT_RECORDS"] = os.environ["TOTAL_RECORDS"]
    if "TOPIC_PARTITIONS" not in os.environ and os.environ.get("OUTPUT_TOPIC_PARTITIONS"):
        args["TOPIC_PARTITIONS"] = os.environ["OUTPUT_TOPIC_PARTITIONS"]
    rate = os.environ.get("ROWS_PER_SECOND")
    if rate and "TRIGGER" not in os.environ and "MAX_RECORDS_PER_BATCH" not in os.environ and argv is None:
        args["TRIGGER"], args["MAX_RECORDS_PER_BATCH"] = "1 second", rate
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "COORDINATOR_URL"):
        if not args[name]:
            parser.error(f"{name} is required (environment variable or --{name.lower().replace('_', '-')})")
    if not args["COORDINATOR_ADMIN_TOKEN"] and not args["COORDINATOR_WRITER_TOKEN"]:
        parser.error("set COORDINATOR_ADMIN_TOKEN (registers the sink) or COORDINATOR_WRITER_TOKEN")
    for name in ("INPUT_RECORDS", "TOPIC_PARTITIONS", "TRANSACTION_TIMEOUT_MS", "MAX_RECORDS_PER_BATCH",
                 "KAFKA_POLL_TIMEOUT_MS", "KAFKA_WAIT_S"):
        if not str(args[name]).isdigit():
            parser.error(f"{name} must be a whole number, got {args[name]!r}")
    if not args["CHECKPOINT_LOCATION"]:
        run = "demo-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        args["CHECKPOINT_LOCATION"] = str(Path(tempfile.gettempdir()) / "exactly-once-demo" / run)
    if not args["SINK_NAME"]:
        args["SINK_NAME"] = sink_name_for(str(args["CHECKPOINT_LOCATION"]))
    args["TRANSACTIONAL_ID_PREFIX"] = args["TRANSACTIONAL_ID_PREFIX"] or args["SINK_NAME"]
    return args


def sink_name_for(checkpoint_location: str) -> str:
    """The checkpoint directory's name as a sink name (`demo-` put before it unless it starts so)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", checkpoint_location.rstrip("/").rsplit("/", 1)[-1]).strip("-.") or "demo"
    return (base if base.startswith("demo") else f"demo-{base}")[:100]


def checkpoint_state(location: str) -> tuple[str | None, int | None]:
    """(query id, last batch in Spark's commit log) of a used local checkpoint; (None, None) if it
    is fresh or not a local path."""
    path = Path(location[len("file:"):] if location.startswith("file:") else location)
    if "://" in location or not (path / "metadata").is_file():
        return None, None
    import json

    try:
        query_id = str(json.loads((path / "metadata").read_text().splitlines()[0])["id"])
    except (IndexError, ValueError, KeyError):
        query_id = "?"
    commits = [int(p.name) for p in (path / "commits").glob("*") if p.name.isdigit()] if (path / "commits").is_dir() else []
    return query_id, max(commits) if commits else None


def wait_for_kafka(bootstrap: str, wait_s: float) -> bool:
    """True once the cluster answers a metadata request; False after `wait_s` of trying."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            admin.list_topics(timeout=max(0.5, min(2.0, deadline - time.monotonic())))
            return True
        except KafkaException:
            if time.monotonic() >= deadline:
                return False
            if not said:
                say(f"waiting for Kafka at {bootstrap} to answer (up to {wait_s:.0f} s) ...")
                said = True
            time.sleep(0.5)


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


def fill_input(bootstrap: str, topic: str, count: int) -> tuple[int, int]:
    """Make the topic hold records "0".."count-1": append those after the ones it has (its end
    offsets summed: the demo input is written by this plain producer only). Returns (had, count)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "example-job-count", "log_level": 3})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        had = sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions)
    finally:
        consumer.close()
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 20})
    failed: list[str] = []
    for n in range(had, count):
        producer.produce(topic, key=str(n), value=str(n), on_delivery=lambda err, _m: err and failed.append(str(err)))
        producer.poll(0)
    if producer.flush(60) or failed:
        raise RuntimeError(f"producing the input failed: {failed[:3]}")
    return had, count


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "example-job-count", "log_level": 3,
                         "isolation.level": "read_committed"})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions}
    finally:
        consumer.close()


def caught_up(query: Any, topic: str, target: dict[int, int]) -> bool:
    """The query's last finished batch ended at or past `target` in every partition of `topic`."""
    import json

    progress = query.lastProgress
    if not progress or query.status["isTriggerActive"]:
        return False
    for source in progress["sources"]:
        end = source["endOffset"]
        end = json.loads(end) if isinstance(end, str) else end
        if isinstance(end, dict) and topic in end:
            return all(int(end[topic].get(str(p), -1)) >= offset for p, offset in target.items())
    return False


def writer_token(s: dict[str, Any]) -> str:
    if not s["COORDINATOR_ADMIN_TOKEN"]:
        return str(s["COORDINATOR_WRITER_TOKEN"])
    with CoordinatorClient(s["COORDINATOR_URL"], s["COORDINATOR_ADMIN_TOKEN"], s["SINK_NAME"]) as admin:
        registered = admin.register_sink(s["TRANSACTIONAL_ID_PREFIX"], s["KAFKA_BOOTSTRAP_SERVERS"],
                                         [s["OUTPUT_TOPIC"]], int(s["TRANSACTION_TIMEOUT_MS"]))
    return str(registered["writer_token"])


def connector_jars(s: dict[str, Any]) -> str:
    if s["SPARK_JARS"]:
        return str(s["SPARK_JARS"])
    from localkafka.maven import spark_kafka_jars

    return ",".join(spark_kafka_jars())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    for noisy in ("py4j", "httpx"):  # a line per HTTP call drowns the batch lines
        logging.getLogger(noisy).setLevel(logging.WARNING)
    s = settings(argv)
    bootstrap, checkpoint = str(s["KAFKA_BOOTSTRAP_SERVERS"]), str(s["CHECKPOINT_LOCATION"])
    query_id, last_batch = checkpoint_state(checkpoint)
    if query_id is None:
        say(f"checkpoint {checkpoint} (new query; to continue it later: --checkpoint-location {checkpoint})")
    else:
        say(f"reusing checkpoint {checkpoint} of query {query_id} (last batch in Spark's commit log: "
            f"{last_batch}): continuing where it stopped; only records after its offsets are read")
    partitions = int(s["TOPIC_PARTITIONS"])
    if not wait_for_kafka(bootstrap, int(s["KAFKA_WAIT_S"])):
        say(f"Kafka at {bootstrap} did not answer within {s['KAFKA_WAIT_S']} s: start it (a local node: "
            "python -m localkafka start) or point KAFKA_BOOTSTRAP_SERVERS (--kafka-bootstrap-servers) at a "
            "running cluster; nothing was read or written", error=True)
        return 2
    ensure_topic(bootstrap, s["INPUT_TOPIC"], partitions)
    ensure_topic(bootstrap, s["OUTPUT_TOPIC"], partitions)
    if int(s["INPUT_RECORDS"]):
        had, count = fill_input(bootstrap, s["INPUT_TOPIC"], int(s["INPUT_RECORDS"]))
        say(f"input {s['INPUT_TOPIC']}: appended records {had}..{count - 1}" if had < count
            else f"input {s['INPUT_TOPIC']} holds {had} records already")
    try:
        token = writer_token(s)
    except CoordinatorError as exc:
        say(str(exc), error=True)
        return 2
    jars = connector_jars(s)

    from pyspark.errors import StreamingQueryException
    from pyspark.sql import SparkSession

    # executors' Python workers need this package and confluent-kafka: in local mode, use this interpreter
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master(s["SPARK_MASTER"]).appName("exactly-once-demo")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.jars", jars))
    for key, value in RECOMMENDED_CONF.items():  # Unix domain sockets to the Python workers (Spark 4.0+)
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    reports: list[BatchReport] = []

    def on_batch(report: BatchReport) -> None:
        reports.append(report)
        say(report.line())

    writer = ExactlyOnceKafkaWriter({
        "kafka.bootstrap.servers": bootstrap,
        "topic": s["OUTPUT_TOPIC"],
        "coordinator.url": s["COORDINATOR_URL"],
        "coordinator.token": token,
        "coordinator.sink": s["SINK_NAME"],
        "checkpointLocation": checkpoint,
        "provenance.headers": "true",
    }, on_batch=on_batch)

    source = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
              .option("subscribe", s["INPUT_TOPIC"]).option("startingOffsets", "earliest")
              .option("kafka.isolation.level", "read_committed").option("failOnDataLoss", "true")
              .option("kafkaConsumer.pollTimeoutMs", int(s["KAFKA_POLL_TIMEOUT_MS"])))
    if int(s["MAX_RECORDS_PER_BATCH"]):
        source = source.option("maxOffsetsPerTrigger", int(s["MAX_RECORDS_PER_BATCH"]))
    rows = source.load().select("key", "value")
    stream = rows.writeStream.foreachBatch(writer).option("checkpointLocation", checkpoint)
    trigger = str(s["TRIGGER"])
    stream = stream.trigger(availableNow=True) if trigger == "availableNow" else stream.trigger(processingTime=trigger)
    # processingTime with INPUT_RECORDS: stop once the input as it is now is processed
    target = end_offsets(bootstrap, s["INPUT_TOPIC"]) if trigger != "availableNow" and int(s["INPUT_RECORDS"]) else None
    query = stream.start()
    say(f"query {query.id} run {query.runId}: {s['INPUT_TOPIC']} -> {s['OUTPUT_TOPIC']} through sink "
        f"{s['SINK_NAME']} (trigger {trigger})")
    try:
        while not query.awaitTermination(0.5):
            if target is not None and caught_up(query, s["INPUT_TOPIC"], target):
                query.stop()
    except StreamingQueryException as exc:
        say(f"the query failed: {exc}", error=True)
        return 1
    except KeyboardInterrupt:
        say("interrupted: stopping the query (a batch in flight is replayed on the next run)")
        return 0
    finally:
        if query.isActive:
            query.stop()
        writer.close()
        spark.stop()
    committed = [r for r in reports if r.action == "committed"]
    if not reports:
        say(f"nothing left to do: {s['INPUT_TOPIC']} has no record after this checkpoint's offsets "
            f"(checkpoint {checkpoint})")
    else:
        empty = sum(r.action == "empty" for r in reports)
        skipped = sum(r.action in ("skipped", "resumed") for r in reports)
        say(f"done: {len(reports)} batches ({len(committed)} committed, {empty} empty, {skipped} already "
            f"committed before), {sum(r.records for r in committed)} records written to {s['OUTPUT_TOPIC']}; "
            f"the input is caught up (checkpoint {checkpoint})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
