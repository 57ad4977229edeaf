#!/usr/bin/env python
"""Throughput, CPU and latency of the coordinator's whole protocol against a real local Postgres.

One batch (checkpoint cycle) = begin with the partition count (it pre-leases each partition's first
try), then the executors' work (each in its own thread, all at once; first tries make no call),
then commit naming every winner with its pre-commit record (as the writer's executor reports it:
figures, and the first offsets of a few topic-partitions written, --topic-partitions): 2 calls per batch.
(Against a server of the per-call protocol it falls back to one lease + one pre-commit per
partition.) Many simulated drivers run batches back to back, one sink each (a query runs one
micro-batch at a time per sink). Modes:
  inprocess  the drivers call `Coordinator` directly: the coordinator's logic and Postgres only;
  http       a real `coordinator serve` (uvicorn, --workers, as deployed) with
             COORDINATOR_KAFKA_CONTROL_PLANE=none, driven by keep-alive HTTP/1.1 connections;
  stack-floor  the same load against bench/stack_floor.py's bare server: the same stack (uvicorn as
             deployed, libpq, Postgres) doing only a batch's durable writes. It runs with the HTTP
             mode by default (--no-stack-floor: not), and `ratio P=… http/stack-floor` says how far
             the coordinator is from what the stack allows on this host, in the same run.

First the floor: what one Python process gets from the same Postgres without the coordinator
(raw psycopg one-row update transactions/s). Then one run per (mode, shape); the report is printed
last, ending with one `key=value` line per run and the P=2 http line as the very last:

    P=2 http batches_per_s=… cpu_ms_per_batch=… calls_per_batch=… p99_ms=… …

cpu_ms_per_batch is the coordinator's CPU (the uvicorn processes; in process, the load processes,
which also run the drivers) plus Postgres', from /proc, per batch; p99_ms is the worst call's p99.

    python bench/protocol_bench.py                               # both modes and the floor, P=2, 64, 200 (~4 min)
    python bench/protocol_bench.py --mode http --seconds 10 --shape 2:16
    python bench/protocol_bench.py --mode http --shape 2:24 --rate 150   # latencies at a paced load
    python bench/protocol_bench.py --database-url postgresql://u:p@host/db
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
    figure_line,
    floor,
    log,
    pg_settings,
    plain_url,
    seed_history,
    start_embedded_postgres,
    statement_cost,
)
from protocol_clients import Server, register_http, register_inprocess, sink_names  # noqa: E402
from protocol_load import CALLS, check_record, run_load, split  # noqa: E402

STACK_FLOOR = "stack-floor"  # the mode of the stack floor's runs (bench/stack_floor.py)
FLOOR_CONNECTIONS = 8  # Postgres connections of each of the floor server's workers
GOAL_BATCHES_PER_S = 1000.0  # two-partition batches per second over HTTP, the target on this machine


def fmt(v: float | None, width: int = 8, nd: int = 1) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{nd}f}"


def cpu_ms(r: dict[str, Any]) -> dict[str, float | None]:
    """CPU ms per batch: the coordinator's (uvicorn's processes over HTTP; the load processes in
    process, where the coordinator runs beside the drivers), Postgres', and the HTTP clients'."""
    if not r["rate"]:
        return {"coordinator": None, "postgres": None, "clients": None}
    cpu, per = r["cpu"], 1000.0 / r["rate"]
    if r["mode"] in ("http", STACK_FLOOR):
        return {"coordinator": cpu["server"] * per, "postgres": cpu["postgres"] * per, "clients": cpu["bench"] * per}
    return {"coordinator": cpu["bench"] * per, "postgres": cpu["postgres"] * per, "clients": None}


def summary_line(r: dict[str, Any]) -> str:
    ms = cpu_ms(r)
    lat = r["latency_ms"]
    calls = [k for k in CALLS if k != "cycle" and k in lat]
    total = None if ms["coordinator"] is None else ms["coordinator"] + ms["postgres"]
    return figure_line(
        f"P={r['partitions']} {r['mode']}",
        batches_per_s=r["rate"],
        cpu_ms_per_batch=total,
        calls_per_batch=r["calls_per_batch"],
        p99_ms=max((lat[k]["p99"] for k in calls), default=None),
        coordinator_cpu_ms=ms["coordinator"],
        postgres_cpu_ms=ms["postgres"],
        commit_p99_ms=lat.get("commit", {}).get("p99"),
        xacts_per_batch=r["db_xacts_per_s"] / r["rate"] if r["rate"] else None,
        statements_per_batch=r["statements_per_batch"],
        round_trips_per_batch=r.get("round_trips_per_batch"),
        errors=sum(r["errors"].values()),
        **({"target_batches_per_s": r["target_rate"], "late_cycles": r["late_cycles"]} if r.get("target_rate") else {}),
    )


def print_run(r: dict[str, Any]) -> None:
    print(f"\n== {r['label']} ==")
    goal = f"  ({r['rate'] / GOAL_BATCHES_PER_S:.3f}x the {GOAL_BATCHES_PER_S:.0f}/s goal)" if r["partitions"] == 2 else ""
    print(f"batches/s: {r['rate']:.1f}{goal}   [{r['completed']} batches in {r['seconds']:.0f} s, "
          f"{r['calls_per_batch'] or 0:.1f} calls per batch]")
    if r.get("target_rate"):
        # the latencies below are at the paced load only if it was reached: a late cycle is one the
        # service kept waiting over a driver's interval
        print(f"paced: {r['target_rate']:g} batches/s asked, {r['rate'] / r['target_rate']:.2f}x reached; "
              f"{r['late_cycles']} of {r['completed']} batches started over one interval late")
    print(f"{'call':<10}{'n':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for k in CALLS:
        lat = r["latency_ms"].get(k)
        if lat:
            print(f"{k:<10}{lat['n']:>9}{fmt(lat['p50'], 9, 2)}{fmt(lat['p99'], 9, 2)}")
    if r["rate"]:
        x, w = r["db_xacts_per_s"], r["db_commits_per_s"]
        print(f"Postgres transactions/s: {x:.0f} = {x / r['rate']:.1f} per batch ({w / r['rate']:.1f} committed); "
              f"new Postgres sessions/s: {r['db_sessions_opened_per_s']:.1f}")
    if r.get("statements_per_batch"):
        st, co, rt = r["statements_per_batch"], r["checkouts_per_batch"], r["round_trips_per_batch"]
        print(f"per batch: {st:.1f} SQL statements, {co:.1f} pool checkouts; {rt:.1f} round trips to Postgres "
              "(the statements, and each BEGIN, COMMIT or ROLLBACK sent on its own)")
    if r.get("row_writes_per_batch"):
        print(f"row writes per batch: {r['row_writes_per_batch']}")
    cpu = r["cpu"]
    print(f"CPU cores used: load {cpu['bench']:.2f}, server {cpu['server']:.2f}, postgres {cpu['postgres']:.2f}, "
          f"other {cpu['other']:.2f}; machine busy {cpu['machine_busy_pct']:.0f}%")
    ms = cpu_ms(r)
    if ms["coordinator"] is not None:
        clients = f" (+ HTTP clients {ms['clients']:.1f} ms)" if ms["clients"] is not None else ""
        server = "the floor's server" if r["mode"] == STACK_FLOOR else "coordinator"
        print(f"CPU per batch: {server} {ms['coordinator']:.2f} ms + Postgres {ms['postgres']:.2f} ms{clients}")
    if r.get("db_sessions"):
        print("Postgres sessions, mean count by state: " + ", ".join(f"{k} {v:.1f}" for k, v in r["db_sessions"].items()))
    if r.get("first_cycle_ms"):
        f = r["first_cycle_ms"]
        print(f"first batch per driver (unmeasured; grows the id pool from empty): median {f[len(f) // 2]:.0f} ms, "
              f"max {f[-1]:.0f} ms")
    rec = r["record"]
    if r["mode"] == STACK_FLOOR:
        ok = rec["ok"]
        print(f"record check: {'ok' if ok else 'MISMATCH'} ({rec['committed_batches']} COMMITTED batches of the "
              f"floor for {rec['cycles_completed_by_drivers']} completed batches, {rec['batches_not_committed']} "
              "not COMMITTED)")
    else:
        ok = rec["committed_checkpoints"] == rec["cycles_completed_by_drivers"] and not rec["leases_not_committed"] \
            and not rec["attempts_not_committed"]
        print(f"record check: {'ok' if ok else 'MISMATCH'} ({rec['committed_checkpoints']} COMMITTED checkpoints for "
              f"{rec['cycles_completed_by_drivers']} completed batches, {rec['attempts_not_committed']} attempts and "
              f"{rec['leases_not_committed']} leases not COMMITTED; id pool per sink "
              f"{rec['pool_size_min']}-{rec['pool_size_max']})")
    r["record_ok"] = ok
    errs = sum(r["errors"].values())
    print(f"errors: {errs}" + (f" {r['errors']}" if errs else ""))
    for ex in r["error_examples"]:
        print(f"  e.g. {ex}")


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
    ap.add_argument("--mode", choices=("inprocess", "http", "both", STACK_FLOOR), default="both",
                    help=f"both: in process and over HTTP; {STACK_FLOOR}: the stack floor's server alone (default both)")
    ap.add_argument("--stack-floor", action=argparse.BooleanOptionalAction, default=None,
                    help="also run each shape against the stack floor's server (bench/stack_floor.py: the same load "
                         "on the same stack with only a batch's durable writes), for the coordinator's ratio to it "
                         "(default: whenever the HTTP mode runs)")
    ap.add_argument("--database-url", help="use this Postgres (migrated in place) instead of an embedded one")
    ap.add_argument("--shape", type=parse_shape, action="append",
                    help="PARTITIONS:DRIVERS, repeatable (default 2:12, 64:4 and 200:1)")
    ap.add_argument("--rate", type=positive,
                    help="paced load: this many batches/s per run, spread evenly over its drivers, each cycle "
                         "started on a schedule (a driver behind it catches up at once), so the calls' latencies "
                         "are read at a stated load below saturation; the run reports the rate it reached and "
                         "how many cycles started late (default: every driver back to back)")
    ap.add_argument("--procs", type=int, default=2, help="load processes the drivers are spread over (default 2)")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn worker processes in http mode (default 2)")
    ap.add_argument("--topic-partitions", type=int, default=8,
                    help="topic-partitions each task's transaction writes: its record carries a first offset for "
                         "the lowest few, as the writer's executor reports them (FIRST_OFFSETS_REPORTED; default 8; 0: none)")
    ap.add_argument("--pool-size", type=int, default=20,
                    help="SQLAlchemy pool_size per engine, as COORDINATOR_DB_POOL_SIZE (default 20)")
    ap.add_argument("--server-log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="COORDINATOR_LOG_LEVEL of the server ('debug' adds uvicorn's access log; above 'info' the "
                         "workers' startup lines are not logged, so only one worker is known to be up before the "
                         "warm-up) (default info)")
    ap.add_argument("--history", type=int, default=50_000,
                    help="committed batches of history seeded before the runs, so Postgres plans for tables of a "
                         "running deployment, not empty ones (default 50000; 0: none)")
    ap.add_argument("--history-ids", type=int, default=40_000,
                    help="free transactional ids seeded with the history, standing for other sinks' pools "
                         "(default 40000: 100 sinks of 400)")
    ap.add_argument("--floor-seconds", type=float, default=3, help="seconds of the floor loop (0: skip)")
    ap.add_argument("--floor-threads", type=int, default=8, help="connections of the floor's update loop (default 8)")
    ap.add_argument("--max-connections", type=int, default=400, help="embedded Postgres max_connections")
    ap.add_argument("--progress-every", type=float, default=5, help="seconds between progress lines")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = args.shape or [(2, 12), (64, 4), (200, 1)]
    modes = ["inprocess", "http"] if args.mode == "both" else [args.mode]
    if (args.stack_floor if args.stack_floor is not None else "http" in modes) and STACK_FLOOR not in modes:
        modes.append(STACK_FLOOR)
    tag = secrets.token_hex(3)
    tmp = Path(tempfile.mkdtemp(prefix="protocol-bench-"))
    os.chmod(tmp, 0o755)  # the embedded server runs as user pgserver when we are root
    server_pg, postgres_pid = None, None
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
            log(f"seeding a history of {args.history} committed batches and {args.history_ids} ids of other "
                "sinks (then VACUUM ANALYZE)")
            log(f"  seeded in {seed_history(url, tag, args.history, ids=args.history_ids):.1f} s")
        log(f"Postgres {settings['server_version']}, fsync={settings['fsync']}, "
            f"synchronous_commit={settings['synchronous_commit']}, max_connections={settings['max_connections']}")
        if args.floor_seconds > 0:
            log(f"floor: raw psycopg one-row update transactions, {args.floor_threads} connections, one process")
            floor_figures = floor(url, args.floor_seconds, args.floor_threads)
            floor_figures.update(statement_cost(url))
        for mode in modes:
            server = None
            try:
                if mode == "http":
                    log(f"starting coordinator serve --workers {args.workers}")
                    server = Server(url, args.workers, args.pool_size, args.server_log_level, tmp / "server.log")
                elif mode == STACK_FLOOR:
                    log(f"starting the stack floor's server (bench/stack_floor.py) --workers {args.workers}")
                    stack_floor.create_schema(plain_url(url))
                    server = stack_floor.FloorServer(plain_url(url), args.workers, FLOOR_CONNECTIONS,
                                                     tmp / "stack-floor.log")
                for partitions, drivers in shapes:
                    names = sink_names(tag, mode, partitions, drivers)
                    if mode == STACK_FLOOR:
                        sinks = stack_floor.register(plain_url(url), names, partitions)
                    elif server is None:
                        sinks = register_inprocess(url, names)
                    else:
                        sinks = register_http(server.base_url, server.admin_token, names)
                    jobs, first = [], 0
                    for n in split(drivers, min(args.procs, drivers)):
                        jobs.append({"mode": "inprocess" if mode == "inprocess" else "http", "url": url, "pool_size": args.pool_size, "partitions": partitions,
                                     "topic_partitions": args.topic_partitions,
                                     "sinks": sinks[first:first + n], "first_driver": first,
                                     "rate": args.rate, "drivers": drivers,
                                     "base_url": server.base_url if server else None})
                        first += n
                    label = (f"{'stack floor' if mode == STACK_FLOOR else mode}, P={partitions}, {drivers} drivers x "
                             f"{partitions} executors"
                             + (f", {args.workers} uvicorn workers" if server else "") + f", {len(jobs)} load procs"
                             + (f", paced at {args.rate:g} batches/s" if args.rate else ""))
                    log(f"run: {label}")
                    r = run_load(label, jobs, seconds=args.seconds, warmup=args.warmup,
                                 progress_every=args.progress_every, url=url,
                                 server_pid=server.proc.pid if server else None, postgres_pid=postgres_pid)
                    r.update(mode=mode, partitions=partitions, drivers=drivers, target_rate=args.rate)
                    completed = r["cycles_total"] + len(r["first_cycle_ms"])
                    r["record"] = stack_floor.check_record(plain_url(url), names, completed) \
                        if mode == STACK_FLOOR else check_record(url, names, completed)
                    results.append(r)
                    log(f"  -> {r['rate']:.1f} batches/s, errors {sum(r['errors'].values())}")
            finally:
                if server is not None:
                    server.stop()
    finally:
        if server_pg is not None:
            server_pg.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)

    print("\n" + "=" * 100)
    print(f"protocol_bench: {platform.node()}, {os.cpu_count()} CPUs (shared: compare figures of one run, not "
          f"digits across runs), Python {platform.python_version()}, Postgres {settings['server_version']} "
          f"fsync={settings['fsync']} synchronous_commit={settings['synchronous_commit']}, "
          f"{args.seconds:.0f} s per run after {args.warmup:.0f} s warm-up")
    for r in results:
        print_run(r)
    print()
    if floor_figures:
        print(figure_line("floor", update_tx_per_s=floor_figures["update_tx_per_s"],
                          select1_per_s=floor_figures["select1_per_s"], connections=args.floor_threads))
        # CPU per one-row SELECT in the client: a cached SQLAlchemy Core statement vs the driver
        print(figure_line("statement_cost", **{k: floor_figures[k] for k in ("sqlalchemy_us", "driver_statement_us", "driver_us", "psycopg_us")}))
        for r in results:
            # how many of the floor's one-row transactions a batch costs, in time
            print(figure_line(f"ratio P={r['partitions']} {r['mode']}",
                              floor_tx_per_batch=floor_figures["update_tx_per_s"] / r["rate"] if r["rate"] else None))
    floors = {r["partitions"]: r for r in results if r["mode"] == STACK_FLOOR and r["rate"]}
    for r in results:
        f = floors.get(r["partitions"])
        if r["mode"] == "http" and f and r["rate"]:
            # the coordinator against the stack's floor on the same host, in the same run
            ours, bound = cpu_ms(r), cpu_ms(f)
            print(figure_line(f"ratio P={r['partitions']} http/stack-floor",
                              cpu_per_batch=(ours["coordinator"] + ours["postgres"]) / (bound["coordinator"] + bound["postgres"]),
                              coordinator_cpu=ours["coordinator"] / bound["coordinator"],
                              postgres_cpu=ours["postgres"] / bound["postgres"],
                              batches_per_s=r["rate"] / f["rate"]))
    # P=2 over HTTP last: the line the goal is read from
    for r in sorted(results, key=lambda r: (r["partitions"] == 2 and r["mode"] == "http", r["mode"], r["partitions"])):
        print(summary_line(r))
    if args.json:
        args.json.write_text(json.dumps({"floor": floor_figures, "runs": results, "settings": settings}, indent=1))
    failed = any(r["errors"] or not r["record_ok"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
