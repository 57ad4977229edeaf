#!/usr/bin/env python
"""Two versions of the coordinator under the same load in one run, in alternating rounds, in process
and over HTTP: what a change costs or saves per batch, measured so that the machine's drift falls
on both sides alike.

The base (a checkout directory such as /work/baseline, or a git revision checked out into a
worktree for the run) and this checkout each get databases of their own (one per mode), migrated
and seeded with a history by their own code (each checkout's bench/measure.py knows its schema),
and over HTTP a `coordinator serve` of their own (record-only control plane, both kept up for the
whole run). Then, round after round, for each shape, path and mode, each side runs the same
drivers (bench/protocol_load.py) for a few seconds in a process that imports that side's code;
which side goes first alternates from round to round. CPU per batch of the coordinator (the load
processes in process, the server's processes over HTTP) and of Postgres comes from /proc.

Two paths (the batch's calls):
  same-calls  begin WITHOUT a partition count, a lease call per partition (both codes take a fresh
              id per try: the old code's Spark Connect path), then the commit with every winner's
              record (the old code takes the records with the commit too, no pre-commit call):
              2 + P calls on both sides. The rebuild's budget is read here (issue 48: P=2 at most
              1.25x the base's CPU per batch, P=200 at most the base's);
  classic     each code's own writer path: begin with the partition count, then the old code
              commits its pre-leases at once (2 calls) where the rebuilt one has every first try
              claim its pre-lease with a lease call (2 + P): the price of issue 50 §2's claims.

    python bench/compare_checkouts.py --base /work/baseline          # P=2 (12 drivers), P=200 (1), 3 rounds
    python bench/compare_checkouts.py --base HEAD~1 --shape 2:12 --rounds 5 --seconds 8 --mode inprocess

Last lines, one per (shape, path, mode), medians over the rounds, ratio = head / base:
    compare P=2 same-calls inprocess base_cpu_ms=… head_cpu_ms=… cpu_ratio=… budget=1.25 … coord_ratio=… pg_ratio=…
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

SIDES = ("base", "head")
PATHS = ("same-calls", "classic")
MODES = ("inprocess", "http")
# issue 48's budget for the rebuild on the same calls: head/base CPU per batch at most this
BUDGET = {2: 1.25, 200: 1.0}


def _worker(args: argparse.Namespace) -> None:
    """One timed run with the code on sys.path (the side's checkout first): prints one JSON line."""
    from protocol_clients import register_http, register_inprocess
    from protocol_load import run_load, split

    job = json.loads(Path(args.job).read_text())
    sinks = job["sinks"]
    if not sinks:  # the first run of this (side, shape, path, mode): its sinks
        if job["mode"] == "inprocess":
            sinks = register_inprocess(job["url"], job["names"])
        else:
            sinks = register_http(job["base_url"], job["admin_token"], job["names"])
    jobs, first = [], 0
    for n in split(len(sinks), min(job["procs"], len(sinks))):
        jobs.append({"mode": job["mode"], "url": job["url"], "pool_size": 20, "partitions": job["partitions"],
                     "topic_partitions": 8, "sinks": sinks[first:first + n], "first_driver": first, "rate": None,
                     "drivers": len(sinks), "base_url": job.get("base_url"), "path": job["path"],
                     "first_batch": job["first_batch"]})
        first += n
    r = run_load(job["label"], jobs, seconds=job["seconds"], warmup=job["warmup"], progress_every=1e9,
                 url=job["url"], server_pid=job.get("server_pid"), postgres_pid=job.get("postgres_pid"))
    rate, cpu = r["rate"], r["cpu"]
    coordinator = cpu["server"] if job["mode"] == "http" else cpu["bench"]
    print(json.dumps({
        "sinks": sinks, "batches_per_s": rate, "errors": r["errors"], "examples": r["error_examples"],
        "calls_per_batch": r["calls_per_batch"],
        "coord_ms": coordinator * 1000 / rate if rate else None,
        "pg_ms": cpu["postgres"] * 1000 / rate if rate else None,
        "commit_p99_ms": r["latency_ms"].get("commit", {}).get("p99"),
        "batch_p50_ms": r["latency_ms"].get("cycle", {}).get("p50"),
        "other_cores": cpu["other"],
    }))


def _env(checkout: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
    return {**clean, "PYTHONPATH": os.pathsep.join([str(checkout), str(BENCH)])}


def _in_checkout(checkout: Path, argv: list[str], timeout: float = 900) -> str:
    """Run Python with the checkout's coordinator first on the path (and this file's bench/)."""
    out = subprocess.run([sys.executable, *argv], env=_env(checkout), cwd=str(checkout), capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"in {checkout}: {out.stderr[-3000:]}")
    return out.stdout


_PREPARE = """
import sys
sys.path.insert(0, sys.argv[3] + "/bench")  # the checkout's own seed_history: it knows its schema
from coordinator.store.db import migrate
migrate(sys.argv[1])
from measure import seed_history
seed_history(sys.argv[1], "compare", checkpoints=int(sys.argv[2]), partitions=4, ids=int(sys.argv[2]))
"""


def _checkout(base: str, tmp: Path) -> tuple[Path, bool]:
    """(directory of the base's code, whether a worktree was made for it)."""
    if Path(base).is_dir():
        return Path(base).resolve(), False
    worktree = tmp / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), base], check=True)
    return worktree, True


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="a checkout directory or a git revision to compare this checkout with")
    ap.add_argument("--shape", action="append", help="PARTITIONS:DRIVERS, repeatable (default 2:12 and 200:1)")
    ap.add_argument("--path", choices=PATHS, action="append", help="repeatable (default both)")
    ap.add_argument("--mode", choices=MODES, action="append", help="repeatable (default both)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5, help="measured seconds per run (default 5)")
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--procs", type=int, default=2, help="load processes per run (default 2)")
    ap.add_argument("--workers", type=int, default=2, help="uvicorn workers of each side's server (default 2)")
    ap.add_argument("--history", type=int, default=20_000, help="committed batches seeded first (default 20,000)")
    ap.add_argument("--database-url", help="a Postgres server to create the databases on (default: embedded)")
    ap.add_argument("--json", type=Path, help="also write every run's figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.worker:
        _worker(args)
        return 0
    if not args.base:
        raise SystemExit("--base is required")
    import psycopg
    from sqlalchemy.engine import make_url

    from measure import figure_line, log, plain_url, start_embedded_postgres
    from protocol_clients import Server

    shapes = [tuple(int(x) for x in s.split(":")) for s in (args.shape or ["2:12", "200:1"])]
    paths, modes = args.path or list(PATHS), args.mode or list(MODES)
    tmp = Path(tempfile.mkdtemp(prefix="compare-checkouts-"))
    os.chmod(tmp, 0o755)
    pg, postgres_pid, created, worktree, admin = None, None, [], None, None
    servers: dict[str, Any] = {}
    try:
        base, made = _checkout(args.base, tmp)
        worktree = base if made else None
        checkouts = {"base": base, "head": ROOT}
        if args.database_url:
            admin = make_url(args.database_url).set(drivername="postgresql+psycopg")
        else:
            pg, url = start_embedded_postgres(tmp, max_connections=300)
            postgres_pid = pg.get_pid()
            admin = make_url(url).set(drivername="postgresql+psycopg")
        urls: dict[tuple[str, str], str] = {}
        with psycopg.connect(plain_url(admin.render_as_string(hide_password=False)), autocommit=True) as conn:
            for side in SIDES:
                for mode in modes:
                    name = f"compare_{side}_{mode}_{secrets.token_hex(3)}"
                    conn.execute(f'CREATE DATABASE "{name}"')
                    created.append(name)
                    urls[side, mode] = admin.set(database=name).render_as_string(hide_password=False)
        for (side, mode), url in urls.items():
            log(f"{side} ({checkouts[side]}), {mode}: migrating and seeding {args.history} batches of history")
            _in_checkout(checkouts[side], ["-c", _PREPARE, url, str(args.history), str(checkouts[side])])
            if mode == "http":
                servers[side] = Server(url, args.workers, 20, "info", tmp / f"server-{side}.log", code=checkouts[side])
        sinks: dict[tuple, list[dict[str, str]]] = {}
        runs: dict[tuple, list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for partitions, drivers in shapes:
                for path in paths:
                    for mode in modes:
                        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                            key = (partitions, path, mode, side)
                            server = servers.get(side) if mode == "http" else None
                            job = {"mode": mode, "url": urls[side, mode], "partitions": partitions, "path": path,
                                   "procs": args.procs, "seconds": args.seconds, "warmup": args.warmup,
                                   "first_batch": r * 1_000_000, "label": f"{side} P={partitions} {path} {mode}",
                                   "sinks": sinks.get(key, []), "postgres_pid": postgres_pid,
                                   "names": [f"cmp-{side[0]}-{mode[0]}-{path[0]}-{partitions}p-{d:04d}"
                                             for d in range(drivers)],
                                   **({"base_url": server.base_url, "admin_token": server.admin_token,
                                       "server_pid": server.proc.pid} if server else {})}
                            job_path = tmp / "job.json"
                            job_path.write_text(json.dumps(job))
                            out = _in_checkout(checkouts[side], [str(BENCH / "compare_checkouts.py"), "--worker",
                                                                 "--job", str(job_path)])
                            got = json.loads(out.strip().splitlines()[-1])
                            if got["errors"] or not got["batches_per_s"]:
                                raise SystemExit(f"{job['label']}: errors {got['errors']}: {got['examples']}")
                            sinks[key] = got.pop("sinks")
                            runs.setdefault(key, []).append(got)
                            log(f"round {r + 1} {job['label']}: {got['batches_per_s']:.1f} batches/s, "
                                f"{got['calls_per_batch']:.0f} calls, coordinator {got['coord_ms']:.2f} + "
                                f"Postgres {got['pg_ms']:.2f} ms per batch (other {got['other_cores']:.2f} cores)")
        print()
        print(f"compare: base {args.base} ({base}) vs head {ROOT}; {os.cpu_count()} CPUs, load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; medians of {args.rounds} rounds, ratio = head / base")
        for partitions, drivers in shapes:
            for path in paths:
                for mode in modes:
                    med = {side: {k: statistics.median(x[k] for x in runs[(partitions, path, mode, side)])
                                  for k in ("coord_ms", "pg_ms", "batches_per_s", "calls_per_batch")}
                           for side in SIDES}
                    cpu = {side: med[side]["coord_ms"] + med[side]["pg_ms"] for side in SIDES}
                    ratio = cpu["head"] / cpu["base"]
                    budget = BUDGET.get(partitions) if path == "same-calls" else None
                    print(figure_line(
                        f"compare P={partitions} {path} {mode}", drivers=drivers,
                        base_cpu_ms=cpu["base"], head_cpu_ms=cpu["head"], cpu_ratio=ratio,
                        **({"budget": budget, "within_budget": "yes" if ratio <= budget else "no"} if budget else {}),
                        base_coord_ms=med["base"]["coord_ms"], head_coord_ms=med["head"]["coord_ms"],
                        coord_ratio=med["head"]["coord_ms"] / med["base"]["coord_ms"],
                        base_pg_ms=med["base"]["pg_ms"], head_pg_ms=med["head"]["pg_ms"],
                        pg_ratio=med["head"]["pg_ms"] / med["base"]["pg_ms"],
                        batches_ratio=med["head"]["batches_per_s"] / med["base"]["batches_per_s"],
                        base_calls=med["base"]["calls_per_batch"], head_calls=med["head"]["calls_per_batch"],
                    ))
        if args.json:
            args.json.write_text(json.dumps({f"{k[0]} {k[1]} {k[2]} {k[3]}": v for k, v in runs.items()}, indent=1))
        return 0
    finally:
        for server in servers.values():
            server.stop()
        if created and args.database_url and admin is not None:
            with psycopg.connect(plain_url(admin.render_as_string(hide_password=False)), autocommit=True) as conn:
                for name in created:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if pg is not None:
            pg.cleanup()
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
