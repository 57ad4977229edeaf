#!/usr/bin/env python
"""Throughput, CPU and latency of the coordinator's protocol against a real local Postgres.

One batch (checkpoint cycle) = begin with the partition count (one id pre-leased per partition),
then each partition's task try asks for its lease (each in its own thread, all at once; the first
try claims its partition's pre-lease), then commit naming every winner with its pre-commit record
(task_attempt_id, producer id, epoch, counts, the first offsets of a few topic-partitions written):
2 + P calls per batch. Many simulated drivers run batches back to back, one sink each (a query runs
one micro-batch at a time per sink). Modes:
  inprocess    the drivers call `Coordinator` directly: the coordinator's logic and Postgres only;
  http         a real `coordinator serve` (uvicorn, --workers, as deployed) with
               COORDINATOR_KAFKA_CONTROL_PLANE=none, driven by keep-alive HTTP/1.1 connections;
  kafka        the same server with the real Kafka control plane against a real broker (localkafka,
               or --bootstrap): every task opens a real transaction on its lease's id
               (bench/kafka_transactions.py says how) and the commit ends each on the broker
               (EndTxn), so the figures are what a deployment pays; the broker's CPU is printed apart;
  stack-floor  the same load against bench/stack_floor.py's bare server: the same stack (uvicorn as
               deployed, libpq, Postgres) doing only a batch's durable writes. It runs with the http
               mode by default (--no-stack-floor: not), and `ratio P=… http/stack-floor` says how far
               the coordinator is from what the stack allows on this host, in the same run.

First the floor: what one Python process gets from the same Postgres without the coordinator
(raw psycopg one-row update transactions/s). Then one run per (mode, shape); the report is printed
last, ending with one `key=value` line per run and the P=2 http line as the very last:

    P=2 http batches_per_s=… cpu_ms_per_batch=… calls_per_batch=… p50_ms=… p99_ms=… …

cpu_ms_per_batch is the coordinator's CPU (the uvicorn processes; in process, the load processes,
which also run the drivers) plus Postgres', from /proc, per batch; p50_ms/p99_ms are the worst
call's.

    python bench/protocol_bench.py                               # inprocess, http, stack floor; P=2, 64, 200
    python bench/protocol_bench.py --mode kafka                  # the real broker (starts one)
    python bench/protocol_bench.py --mode all                    # every mode
    python bench/protocol_bench.py --mode http --shape 2:24 --rate 150   # latencies at a paced load
    python bench/protocol_bench.py --database-url postgresql://u:p@host/db
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(BENCH), str(ROOT)):  # `python bench/protocol_bench.py` from a checkout
    if p not in sys.path:
        sys.path.insert(0, p)

import stack_floor  # noqa: E402
from measure import (  # noqa: E402
    floor,
    log,
    pg_settings,
    plain_url,
    seed_history,
    start_embedded_postgres,
    statement_cost,
)
from protocol_clients import KafkaSide, Server, register_http, register_inprocess, sink_names  # noqa: E402
from protocol_load import check_record, run_load, split  # noqa: E402
from protocol_report import STACK_FLOOR, print_report  # noqa: E402

FLOOR_CONNECTIONS = 8  # Postgres connections of each of the floor server's workers
MODES = ("inprocess", "http", "kafka", STACK_FLOOR)


def parse_shape(s: str) -> tuple[int, int]:
    try:
        p, d = s.split(":")
        return int(p), int(d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be PARTITIONS:DRIVERS, not {s!r}") from None


def positive(s: str) -> float:
    try:
        value = float(s)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a rate must be a positive number of batches/s, not {s!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10, help="measured seconds per (mode, shape) (default 10)")
    ap.add_argument("--warmup", type=float, default=2, help="unmeasured seconds before each window (default 2)")
    ap.add_argument("--mode", choices=(*MODES, "both", "all"), action="append",
                    help="repeatable; both: inprocess and http (the default); all: every mode")
    ap.add_argument("--stack-floor", action=argparse.BooleanOptionalAction, default=None,
                    help="also run each shape against the stack floor's server (bench/stack_floor.py: the same load "
                         "on the same stack with only a batch's durable writes), for the coordinator's ratio to it "
                         "(default: whenever the http mode runs)")
    ap.add_argument("--database-url", help="use this Postgres (migrated in place) instead of an embedded one")
    ap.add_argument("--bootstrap", help="kafka mode: this Kafka instead of a broker started with localkafka")
    ap.add_argument("--shape", type=parse_shape, action="append",
                    help="PARTITIONS:DRIVERS, repeatable (default 2:12, 64:4 and 200:1)")
    ap.add_argument("--rate", type=positive,
                    help="paced load: this many batches/s per run, spread evenly over its drivers, each cycle "
                         "started on a schedule (a driver behind it catches up at once), so the calls' latencies "
                         "are read at a stated load below saturation; the run reports the rate it reached and "
                         "how many cycles started late (default: every driver back to back)")
    ap.add_argument("--procs", type=int, default=2, help="load processes the drivers are spread over (default 2)")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn worker processes when served (default 2)")
    ap.add_argument("--topic-partitions", type=int, default=8,
                    help="topic-partitions each task's transaction writes (in process and http: its record names "
                         "the first offset of the lowest 4, as the writer's executor reports them; kafka mode: the "
                         "topic's partition count, each task writing one) (default 8)")
    ap.add_argument("--records-per-task", type=int, default=1,
                    help="kafka mode: records each task's transaction writes (default 1: the protocol's cost)")
    ap.add_argument("--pool-size", type=int, default=20,
                    help="SQLAlchemy pool_size per engine, as COORDINATOR_DB_POOL_SIZE (default 20)")
    ap.add_argument("--server-log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="COORDINATOR_LOG_LEVEL of the server (default info: the workers' startup lines are "
                         "awaited in its log)")
    ap.add_argument("--history", type=int, default=50_000,
                    help="committed batches of history seeded before the runs, so Postgres plans for tables of a "
                         "running deployment, not empty ones (default 50000; 0: none)")
    ap.add_argument("--history-ids", type=int, default=40_000,
                    help="pool ordinals of another retired sink seeded with the history (default 40000)")
    ap.add_argument("--floor-seconds", type=float, default=3, help="seconds of the floor loop (0: skip)")
    ap.add_argument("--floor-threads", type=int, default=8, help="connections of the floor's update loop (default 8)")
    ap.add_argument("--max-connections", type=int, default=400, help="embedded Postgres max_connections")
    ap.add_argument("--progress-every", type=float, default=5, help="seconds between progress lines")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    return ap.parse_args(argv)


def modes_of(args: argparse.Namespace) -> list[str]:
    asked = set()
    for m in args.mode or ["both"]:
        asked |= {"both": {"inprocess", "http"}, "all": set(MODES)}.get(m, {m})
    if args.stack_floor is not None:
        asked = asked | {STACK_FLOOR} if args.stack_floor else asked - {STACK_FLOOR}
    elif "http" in asked:
        asked.add(STACK_FLOOR)
    return [m for m in MODES if m in asked]


class Broker:
    """kafka mode's broker: one started with localkafka (stopped at the end), or --bootstrap's."""

    def __init__(self, tmp: Path, bootstrap: str | None) -> None:
        self.cluster = None
        if bootstrap:
            self.bootstrap, self.pid = bootstrap, None
            return
        from localkafka import LocalKafka

        log("starting a Kafka broker (localkafka)")
        self.cluster = LocalKafka(tmp / "kafka", heap="512m")
        self.cluster.start()
        self.bootstrap, self.pid = self.cluster.bootstrap_servers, self.cluster.nodes[0].pid

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


def run_shapes(args: argparse.Namespace, mode: str, url: str, tag: str, tmp: Path, postgres_pid: int | None,
               broker: Broker | None) -> list[dict[str, Any]]:
    """Every shape in one mode: its server started (if served), sinks registered, one run each."""
    from kafka_transactions import count_committed, create_topic

    shapes = args.shape or [(2, 12), (64, 4), (200, 1)]
    server: Any = None
    results = []
    try:
        if mode in ("http", "kafka"):
            log(f"starting coordinator serve --workers {args.workers} (control plane "
                f"{'kafka' if mode == 'kafka' else 'none'})")
            server = Server(url, args.workers, args.pool_size, args.server_log_level, tmp / f"server-{mode}.log",
                            control_plane="kafka" if mode == "kafka" else "none")
        elif mode == STACK_FLOOR:
            log(f"starting the stack floor's server (bench/stack_floor.py) --workers {args.workers}")
            stack_floor.create_schema(plain_url(url))
            server = stack_floor.FloorServer(plain_url(url), args.workers, FLOOR_CONNECTIONS, tmp / "stack-floor.log")
        for partitions, drivers in shapes:
            names = sink_names(tag, mode, partitions, drivers)
            kafka = None
            if mode == "kafka":
                assert broker is not None
                kafka = KafkaSide(broker.bootstrap, f"bench-{tag}-{partitions}p", args.topic_partitions)
                create_topic(kafka.bootstrap, kafka.topic, kafka.topic_partitions)
            if mode == STACK_FLOOR:
                sinks = stack_floor.register(plain_url(url), names, partitions)
            elif server is None:
                sinks = register_inprocess(url, names)
            else:
                sinks = register_http(server.base_url, server.admin_token, names, kafka)
            jobs, first = [], 0
            for n in split(drivers, min(args.procs, drivers)):
                jobs.append({"mode": "inprocess" if mode == "inprocess" else "http", "url": url,
                             "pool_size": args.pool_size, "partitions": partitions,
                             "topic_partitions": args.topic_partitions, "sinks": sinks[first:first + n],
                             "first_driver": first, "rate": args.rate, "drivers": drivers,
                             "base_url": server.base_url if server else None,
                             "kafka": kafka and {"bootstrap": kafka.bootstrap, "topic": kafka.topic,
                                                 "topic_partitions": kafka.topic_partitions,
                                                 "records_per_task": args.records_per_task}})
                first += n
            label = (f"{'stack floor' if mode == STACK_FLOOR else mode}, P={partitions}, {drivers} drivers x "
                     f"{partitions} executors" + (f", {args.workers} uvicorn workers" if server else "")
                     + f", {len(jobs)} load procs" + (f", paced at {args.rate:g} batches/s" if args.rate else ""))
            log(f"run: {label}")
            r = run_load(label, jobs, seconds=args.seconds, warmup=args.warmup, progress_every=args.progress_every,
                         url=url, server_pid=server.proc.pid if server else None, postgres_pid=postgres_pid,
                         broker_pid=broker.pid if broker and mode == "kafka" else None)
            r.update(mode=mode, partitions=partitions, drivers=drivers, target_rate=args.rate)
            completed = r["cycles_total"] + len(r["first_cycle_ms"])
            r["record"] = stack_floor.check_record(plain_url(url), names, completed) \
                if mode == STACK_FLOOR else check_record(url, names, completed)
            if kafka is not None:
                r["record"]["written_records"] = r["transactions"] * args.records_per_task
                r["record"]["visible_records"] = count_committed(kafka.bootstrap, kafka.topic)
            results.append(r)
            log(f"  -> {r['rate']:.1f} batches/s, errors {sum(r['errors'].values())}")
    finally:
        if server is not None:
            server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = modes_of(args)
    tag = secrets.token_hex(3)
    tmp = Path(tempfile.mkdtemp(prefix="protocol-bench-"))
    os.chmod(tmp, 0o755)  # the embedded server runs as user pgserver when we are root
    server_pg, postgres_pid, broker = None, None, None
    results: list[dict[str, Any]] = []
    floor_figures: dict[str, float] | None = None
    try:
        if args.database_url:
            url = args.database_url
            log(f"using Postgres at {url.split('@')[-1]}")
        else:
            log(f"starting an embedded Postgres in {tmp}")
            server_pg, url = start_embedded_postgres(tmp, args.max_connections)
            postgres_pid = server_pg.get_pid()
        from coordinator.store.db import migrate

        migrate(url)
        settings = pg_settings(url)
        if args.history > 0:
            log(f"seeding a history of {args.history} committed batches and {args.history_ids} ids of another "
                "sink (then VACUUM ANALYZE)")
            log(f"  seeded in {seed_history(url, tag, args.history, ids=args.history_ids):.1f} s")
        log(f"Postgres {settings['server_version']}, fsync={settings['fsync']}, "
            f"synchronous_commit={settings['synchronous_commit']}, max_connections={settings['max_connections']}")
        if args.floor_seconds > 0:
            log(f"floor: raw psycopg one-row update transactions, {args.floor_threads} connections, one process")
            floor_figures = floor(url, args.floor_seconds, args.floor_threads)
            floor_figures.update(statement_cost(url))
        for mode in modes:
            if mode == "kafka":  # started for its runs only: an idle JVM would load the others' host
                broker = Broker(tmp, args.bootstrap)
            try:
                results += run_shapes(args, mode, url, tag, tmp, postgres_pid, broker)
            finally:
                if broker is not None:
                    broker.stop()
                    broker = None
    finally:
        if broker is not None:
            broker.stop()
        if server_pg is not None:
            server_pg.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)

    print_report(results, settings, floor_figures, args.seconds, args.warmup, args.floor_threads)
    if args.json:
        args.json.write_text(json.dumps({"floor": floor_figures, "runs": results, "settings": settings}, indent=1))
    failed = any(r["errors"] or not r["record_ok"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
