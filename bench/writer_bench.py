#!/usr/bin/env python
"""The exactly-once writer against Spark's own Kafka sink, in one run on a real broker: records/s
and CPU per record of each path, and the wall time of small micro-batches.

Paths (bench/writer_paths.py): `spark-kafka-sink` (`.writeStream.format("kafka")`, at-least-once),
`native-sink` (`.format("kafka_eos")`), `foreach-batch` (`foreachBatch(ExactlyOnceKafkaWriter)`:
at most one write task per task slot), and for small batches also `foreach-batch-per-partition`
(`max.write.tasks=0`: a task per partition, as the sinks write), each a streaming query over the
same parquet files (one per micro-batch) with `repartition(P)`, in one local Spark session, to one
broker, one path after the other.

Shapes (throughput): `bench` (--batches x --records-per-batch records of ~--value-bytes, --partitions
Spark partitions) and `wide` (16 partitions x 1 KB values). Each path runs --rounds times per shape,
alternating order; its figure is records / the query's wall time (median over rounds) and CPU per
record: every party's CPU from /proc (bench/writer_cpu.py: the driver, the Spark JVM, every Python
worker including those that exited, the broker, the coordinator, Postgres). Every path's topic is
read back by a read_committed consumer after its run: all records, or the bench exits non-zero.

Small batches: --small-batches micro-batches of 2,000 records at 8 and 64 partitions; the figure is
the median of Spark's own per-batch wall time (triggerExecution), the first batch left out.

The last lines: `ratio <path> <shape> over_spark_sink=.. cpu_over_spark_sink=..` for each
exactly-once path and shape, `ratio small P=<n> <path> wall_over_spark_sink=..`, `fastest exactly-once
path=..`, then `ratio exactly-once over_spark_sink=R cpu_over_spark_sink=C` for the fastest
exactly-once path (records/s, bench shape).

`begin` names no partition count (every task try asks the lease route for its id), so the figures
are the same against the coordinator before and after the single-use pre-lease (issue 50 §2).

It starts a single-node Apache Kafka (localkafka/) and `coordinator serve` (embedded Postgres,
Kafka control plane `kafka`) unless --bootstrap / --coordinator-url are given.

    python bench/writer_bench.py                              # every shape, 2 rounds, small batches (~15 min)
    python bench/writer_bench.py --shapes bench --rounds 1 --small-batches 0
    python bench/writer_bench.py --bootstrap host:9092 --coordinator-url http://c:8000 --admin-token T
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402
import writer_cpu  # noqa: E402
import writer_paths as wp  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    batches: int
    records: int  # per batch
    value_bytes: int
    partitions: int

    @property
    def total(self) -> int:
        return self.batches * self.records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--records-per-batch", type=int, default=100_000)
    p.add_argument("--value-bytes", type=int, default=100)
    p.add_argument("--partitions", type=int, default=4, help="Spark partitions per batch (bench shape)")
    p.add_argument("--wide-records-per-batch", type=int, default=25_000, help="records per batch of the wide shape")
    p.add_argument("--shapes", nargs="+", default=["bench", "wide"], choices=("bench", "wide"))
    p.add_argument("--topic-partitions", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--paths", nargs="+", default=[wp.SPARK_SINK, wp.NATIVE, wp.FOREACH], choices=wp.PATHS,
                   help="paths of the throughput shapes")
    p.add_argument("--small-paths", nargs="+", default=list(wp.PATHS), choices=wp.PATHS,
                   help="paths of the small batches")
    p.add_argument("--small-batches", type=int, default=6, help="micro-batches of 2,000 records per size (0: none)")
    p.add_argument("--small-partitions", type=int, nargs="+", default=[8, 64])
    p.add_argument("--writer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the exactly-once paths, e.g. provenance.headers=true (repeatable)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--bootstrap", help="an existing Kafka (default: start one with localkafka)")
    p.add_argument("--coordinator-url", help="an existing coordinator (default: start one on an embedded Postgres)")
    p.add_argument("--admin-token", help="with --coordinator-url")
    args = p.parse_args()
    writer_options = dict(option.split("=", 1) for option in args.writer_option)
    shapes = [s for s in (Shape("bench", args.batches, args.records_per_batch, args.value_bytes, args.partitions),
                          Shape("wide", args.batches, args.wide_records_per_batch, 1000, 16)) if s.name in args.shapes]

    workdir = Path(tempfile.mkdtemp(prefix="writer-bench-"))
    procs: list[Any] = []  # processes, and the Kafka cluster (stopped with .stop())
    spark = None
    try:
        if args.bootstrap:
            bootstrap = args.bootstrap
        else:
            kafka, bootstrap = wp.start_kafka(workdir)
            procs.append(kafka)
        coordinator_pid = postgres_pid = None  # an external coordinator: not counted
        if args.coordinator_url:
            url, admin_token = args.coordinator_url, args.admin_token
        else:
            coordinator, url, admin_token = wp.start_coordinator(workdir)
            procs.append(coordinator)
            coordinator_pid, postgres_pid = coordinator.pid, measure.postgres_pid_under(workdir)
        print(f"broker {bootstrap} ({'given' if args.bootstrap else f'Apache Kafka {kafka.version}, one node, same machine'}), "
              f"coordinator {url}, master {args.master}, spark.python.unix.domain.socket.enabled=true", flush=True)
        spark = wp.spark_session(args.master, args.partitions)

        def run_path(path: str, data: Path, partitions: int, label: str) -> tuple[float, dict[str, float], int, Any]:
            """Wall seconds and CPU seconds by party of the query, the records read_committed sees, the query."""
            topic = wp.create_topic(bootstrap, args.topic_partitions)
            coordinator_sink = None
            if path != wp.SPARK_SINK:
                sink, token = wp.register(url, admin_token, bootstrap, topic, path)
                coordinator_sink = (url, sink, token)
            checkpoint = workdir / f"chk-{path}-{label}"
            before = writer_cpu.snapshot(coordinator_pid, postgres_pid)
            started = time.monotonic()
            query = wp.start_query(spark, path, data, checkpoint, partitions, bootstrap, topic, coordinator_sink,
                                   writer_options)
            wp.run_query(query)
            seconds = time.monotonic() - started
            cpu = writer_cpu.seconds_between(before, writer_cpu.snapshot(coordinator_pid, postgres_pid))
            return seconds, cpu, wp.visible_records(bootstrap, topic), query

        # warm-up (not measured): Python workers, JVM classes, first connections, for every path, and
        # two batches of the bench shape so the JIT compiles each path's per-record code (with 10,000
        # records the first measured round of Spark's sink cost up to 1.8x its later ones)
        warmup = workdir / "warmup"
        wp.write_data(spark, warmup, 2, args.records_per_batch, args.value_bytes)
        for path in args.paths:
            run_path(path, warmup, args.partitions, "warmup")

        rates: dict[tuple[str, str], list[float]] = {}
        cpu_us: dict[tuple[str, str], list[float]] = {}
        for shape in shapes:
            data = workdir / f"data-{shape.name}"
            wp.write_data(spark, data, shape.batches, shape.records, shape.value_bytes)
            print(f"shape {shape.name}: {shape.batches} batches x {shape.records} records of ~{shape.value_bytes + 6} "
                  f"bytes ({shape.total} records), {shape.partitions} Spark partitions per batch", flush=True)
            for rnd in range(args.rounds):
                for path in args.paths if rnd % 2 == 0 else args.paths[::-1]:
                    seconds, cpu, visible, _ = run_path(path, data, shape.partitions, f"{shape.name}-{rnd}")
                    if visible < shape.total or (path in wp.EXACTLY_ONCE and visible != shape.total):
                        raise SystemExit(f"{path}: {shape.total} records written, {visible} visible to read_committed")
                    key = (shape.name, path)
                    rates.setdefault(key, []).append(shape.total / seconds)
                    cpu_us.setdefault(key, []).append(sum(cpu.values()) / shape.total * 1e6)
                    print(measure.figure_line(f"round {rnd + 1} {shape.name} {path}", records=shape.total,
                                              visible=visible, seconds=seconds, records_per_s=shape.total / seconds,
                                              cpu_us_per_record=cpu_us[key][-1],
                                              **{f"{k}_cpu_s": v for k, v in cpu.items()}), flush=True)
            for path in args.paths:
                key = (shape.name, path)
                print(measure.figure_line(f"path {path} {shape.name}", records_per_s=statistics.median(rates[key]),
                                          cpu_us_per_record=statistics.median(cpu_us[key])), flush=True)

        walls: dict[tuple[int, str], float] = {}
        if args.small_batches:
            for partitions in args.small_partitions:
                data = workdir / f"data-small-{partitions}"
                wp.write_data(spark, data, args.small_batches, 2_000, args.value_bytes)
                for path in args.small_paths:
                    _, cpu, visible, query = run_path(path, data, partitions, f"small-{partitions}")
                    if visible != args.small_batches * 2_000:
                        raise SystemExit(f"{path}: {args.small_batches * 2_000} records written, {visible} visible")
                    times = wp.batch_wall_times(query)[1:]  # the first batch starts the query's workers
                    walls[(partitions, path)] = statistics.median(times)
                    print(measure.figure_line(f"small P={partitions} {path}", records=2_000, batches=len(times),
                                              wall_ms_p50=1000 * walls[(partitions, path)],
                                              wall_ms_max=1000 * max(times),
                                              cpu_ms_per_batch=1000 * sum(cpu.values()) / args.small_batches,
                                              **{f"{k}_cpu_ms": 1000 * v / args.small_batches for k, v in cpu.items()}),
                          flush=True)

        return report_ratios(shapes, args.paths, args.small_paths, rates, cpu_us, walls, args.small_partitions)
    finally:
        if spark is not None:
            spark.stop()
        wp.stop_all(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def report_ratios(shapes: list[Shape], paths: list[str], small_paths: list[str],
                  rates: dict[tuple[str, str], list[float]], cpu_us: dict[tuple[str, str], list[float]],
                  walls: dict[tuple[int, str], float], small_partitions: list[int]) -> int:
    median = statistics.median
    for partitions in small_partitions:
        for path in (x for x in small_paths if x in wp.EXACTLY_ONCE):
            if (partitions, path) in walls and (partitions, wp.SPARK_SINK) in walls:
                print(measure.figure_line(f"ratio small P={partitions} {path}", wall_over_spark_sink=(
                    f"{walls[(partitions, path)] / walls[(partitions, wp.SPARK_SINK)]:.2f}")), flush=True)
    eos = [x for x in paths if x in wp.EXACTLY_ONCE]
    if wp.SPARK_SINK not in paths or not eos or not shapes:
        return 0
    for shape in shapes:
        base = (shape.name, wp.SPARK_SINK)
        for path in eos:
            key = (shape.name, path)
            print(measure.figure_line(f"ratio {path} {shape.name}",
                                      over_spark_sink=f"{median(rates[key]) / median(rates[base]):.2f}",
                                      cpu_over_spark_sink=f"{median(cpu_us[key]) / median(cpu_us[base]):.2f}"),
                  flush=True)
    shape = shapes[0].name
    fastest = max(eos, key=lambda x: median(rates[(shape, x)]))
    base = (shape, wp.SPARK_SINK)
    print(f"fastest exactly-once path={fastest} shape={shape}", flush=True)
    print(measure.figure_line("ratio exactly-once",
                              over_spark_sink=f"{median(rates[(shape, fastest)]) / median(rates[base]):.2f}",
                              cpu_over_spark_sink=f"{median(cpu_us[(shape, fastest)]) / median(cpu_us[base]):.2f}"),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
