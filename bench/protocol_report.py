"""What protocol_bench.py prints: a block per run, then the figure lines (`label key=value ...`),
the P=2 http line last."""

from __future__ import annotations

import os
import platform
from typing import Any

from measure import figure_line
from protocol_load import CALLS, TIMINGS

STACK_FLOOR = "stack-floor"  # the mode of the stack floor's runs (bench/stack_floor.py)
SERVED = ("http", "kafka", STACK_FLOOR)  # modes where a server process does the coordinator's work


def fmt(v: float | None, width: int = 8, nd: int = 1) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{nd}f}"


def cpu_ms(r: dict[str, Any]) -> dict[str, float | None]:
    """CPU ms per batch: the coordinator's (uvicorn's processes when served; in process, the load
    processes, where the coordinator runs beside the drivers), Postgres', the broker's, and the
    load's (HTTP clients, and in kafka mode the executors' producers)."""
    if not r["rate"]:
        return {"coordinator": None, "postgres": None, "broker": None, "load": None}
    cpu, per = r["cpu"], 1000.0 / r["rate"]
    if r["mode"] in SERVED:
        return {"coordinator": cpu["server"] * per, "postgres": cpu["postgres"] * per,
                "broker": cpu["broker"] * per if r["mode"] == "kafka" else None, "load": cpu["bench"] * per}
    return {"coordinator": cpu["bench"] * per, "postgres": cpu["postgres"] * per, "broker": None, "load": None}


def summary_line(r: dict[str, Any]) -> str:
    ms = cpu_ms(r)
    lat = r["latency_ms"]
    calls = [k for k in CALLS if k in lat]
    total = None if ms["coordinator"] is None else ms["coordinator"] + ms["postgres"]
    return figure_line(
        f"P={r['partitions']} {r['mode']}",
        batches_per_s=r["rate"],
        cpu_ms_per_batch=total,
        calls_per_batch=r["calls_per_batch"],
        p50_ms=max((lat[k]["p50"] for k in calls), default=None),
        p99_ms=max((lat[k]["p99"] for k in calls), default=None),
        coordinator_cpu_ms=ms["coordinator"],
        postgres_cpu_ms=ms["postgres"],
        **({"broker_cpu_ms": ms["broker"], "load_cpu_ms": ms["load"]} if r["mode"] == "kafka" else {}),
        begin_p99_ms=lat.get("begin", {}).get("p99"),
        lease_p99_ms=lat.get("lease", {}).get("p99"),
        commit_p99_ms=lat.get("commit", {}).get("p99"),
        batch_p50_ms=lat.get("cycle", {}).get("p50"),
        xacts_per_batch=r["db_xacts_per_s"] / r["rate"] if r["rate"] else None,
        statements_per_batch=r["statements_per_batch"],
        errors=sum(r["errors"].values()),
        **({"target_batches_per_s": r["target_rate"], "late_cycles": r["late_cycles"]} if r.get("target_rate") else {}),
    )


def print_run(r: dict[str, Any]) -> None:
    print(f"\n== {r['label']} ==")
    print(f"batches/s: {r['rate']:.1f}   [{r['completed']} batches in {r['seconds']:.0f} s, "
          f"{r['calls_per_batch'] or 0:.1f} calls per batch]")
    if r.get("target_rate"):
        # the latencies below are at the paced load only if it was reached: a late cycle is one the
        # service kept waiting over a driver's interval
        print(f"paced: {r['target_rate']:g} batches/s asked, {r['rate'] / r['target_rate']:.2f}x reached; "
              f"{r['late_cycles']} of {r['completed']} batches started over one interval late")
    print(f"{'call':<10}{'n':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for k in TIMINGS:
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
              "(the statements, and each BEGIN, COMMIT or ROLLBACK)")
    if r.get("row_writes_per_batch"):
        print(f"row writes per batch: {r['row_writes_per_batch']}")
    cpu = r["cpu"]
    print(f"CPU cores used: load {cpu['bench']:.2f}, server {cpu['server']:.2f}, postgres {cpu['postgres']:.2f}, "
          f"broker {cpu['broker']:.2f}, other {cpu['other']:.2f}; machine busy {cpu['machine_busy_pct']:.0f}%")
    ms = cpu_ms(r)
    if ms["coordinator"] is not None:
        extra = "" if ms["load"] is None else f" (+ load {ms['load']:.1f} ms)"
        if ms["broker"] is not None:
            extra = f" + broker {ms['broker']:.2f} ms" + extra
        server = "the floor's server" if r["mode"] == STACK_FLOOR else "coordinator"
        print(f"CPU per batch: {server} {ms['coordinator']:.2f} ms + Postgres {ms['postgres']:.2f} ms{extra}")
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
        if "visible_records" in rec:
            seen = rec["visible_records"] == rec["written_records"]
            ok = ok and seen
            print(f"kafka check: {'ok' if seen else 'MISMATCH'} (read_committed sees {rec['visible_records']} of the "
                  f"{rec['written_records']} records the tasks' transactions wrote; each driver's last batch "
                  "committed by the coordinator's EndTxn alone)")
    r["record_ok"] = ok
    errs = sum(r["errors"].values())
    print(f"errors: {errs}" + (f" {r['errors']}" if errs else ""))
    for ex in r["error_examples"]:
        print(f"  e.g. {ex}")


def print_report(results: list[dict[str, Any]], settings: dict[str, str], floor_figures: dict[str, float] | None,
                 seconds: float, warmup: float, floor_threads: int) -> None:
    print("\n" + "=" * 100)
    print(f"protocol_bench: {platform.node()}, {os.cpu_count()} CPUs (shared: compare figures of one run, not "
          f"digits across runs), load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}, Python "
          f"{platform.python_version()}, Postgres {settings['server_version']} fsync={settings['fsync']} "
          f"synchronous_commit={settings['synchronous_commit']}, {seconds:.0f} s per run after {warmup:.0f} s warm-up")
    for r in results:
        print_run(r)
    print()
    if floor_figures:
        print(figure_line("floor", update_tx_per_s=floor_figures["update_tx_per_s"],
                          select1_per_s=floor_figures["select1_per_s"], connections=floor_threads))
        # CPU per one-row SELECT in the client: a cached SQLAlchemy Core statement vs the driver
        print(figure_line("statement_cost", **{k: floor_figures[k] for k in ("sqlalchemy_us", "driver_us", "psycopg_us")}))
    floors = {r["partitions"]: r for r in results if r["mode"] == STACK_FLOOR and r["rate"]}
    by_shape = {(r["mode"], r["partitions"]): r for r in results if r["rate"]}
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
        http = by_shape.get(("http", r["partitions"]))
        if r["mode"] == "kafka" and http and r["rate"]:
            # what the real broker adds to the record-only plane's figures, same run
            k, h = cpu_ms(r), cpu_ms(http)
            print(figure_line(f"ratio P={r['partitions']} kafka/http",
                              cpu_per_batch=(k["coordinator"] + k["postgres"]) / (h["coordinator"] + h["postgres"]),
                              coordinator_cpu=k["coordinator"] / h["coordinator"],
                              batch_p50=r["latency_ms"]["cycle"]["p50"] / http["latency_ms"]["cycle"]["p50"]))
    # P=2 over HTTP last: the single summary line
    for r in sorted(results, key=lambda r: (r["partitions"] == 2 and r["mode"] == "http", r["mode"], r["partitions"])):
        print(summary_line(r))
