#!/usr/bin/env python
"""Two versions of the coordinator on the same Postgres, in alternating rounds: what a change
saves per batch, measured so that the machine's drift falls on both sides alike.

A base revision (a git worktree made for the run) and this checkout each get a database of their
own, migrated and seeded with a history by their own code. Then, round after round and shape by
shape, base and head each run D drivers of P-partition batches in process (begin with the
partition count, then commit naming every first try with its record, as the writer does) for a
few seconds, in a process of their own. Postgres' CPU (the server's process tree) and the
coordinator's (the run's process) come from /proc, per batch. HTTP adds the same fixed cost to
both sides, and its noise on a shared machine (+-10-30% between runs) hides differences this
size, so it is left out.

    python bench/compare_checkouts.py --base aea9421                  # P=2 (12 drivers) and P=200, 3 rounds
    python bench/compare_checkouts.py --base HEAD~1 --shape 2:12 --rounds 5 --seconds 8

Last lines, one per shape (medians over the rounds; ratio = head / base):
    compare P=2 base_pg_ms=3.61 head_pg_ms=3.16 pg_ratio=0.87 base_coord_ms=... coord_ratio=... batches_ratio=...
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
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# first offsets per task record: the writer's FIRST_OFFSETS_REPORTED (sparkclient/executor.py), written
# out because a base checkout may predate it
FIRST_OFFSETS = 4


def _worker(args: argparse.Namespace) -> None:
    """One timed run in the checkout on sys.path[0]: prints one JSON line."""
    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.protocol.model import PartitionResult, PrecommitRecord
    from coordinator.service import Coordinator, Limits, SinkSpec
    from coordinator.store.db import make_engine

    from measure import CLK_TCK, _descendants, _proc_table  # this file's bench/, whichever checkout runs

    partitions, drivers = args.partitions, args.drivers
    engine = make_engine(args.database_url, pool_size=drivers + 2)
    c = Coordinator(engine, RecordingControlPlane(), limits=Limits(max_partitions=max(256, partitions)))
    names = [f"cmp-{secrets.token_hex(4)}-{d}" for d in range(drivers)]
    for name in names:
        c.register_sink(SinkSpec(name, name + "-eos", "localhost:9", ["out"]), "compare")
    generations = {name: c.start_generation(name, "q", "r", "compare")[0] for name in names}
    measuring, stop, lock, done, errors = [False], [False], threading.Lock(), [0], []

    def drive(name: str) -> None:
        batch = 0
        try:
            while not stop[0]:
                begun = c.begin_checkpoint(name, batch, generations[name], "compare", partitions=partitions)
                results = [PartitionResult(x.partition, x.id, PrecommitRecord(
                    1000 + x.partition, 0, 10, 500, 3, [["out", k, 10 * batch] for k in range(FIRST_OFFSETS)]))
                    for x in begun.pre_leases]
                answer = c.commit(name, batch, begun.attempt.number, generations[name], results, "compare")
                if answer.checkpoint.state != "COMMITTED":
                    raise RuntimeError(f"batch {batch} of {name} ended {answer.checkpoint.state}")
                batch += 1
                if measuring[0]:
                    with lock:
                        done[0] += 1
        except Exception as exc:  # reported, and the run fails
            errors.append(repr(exc))
            stop[0] = True

    def pg_ticks() -> int:
        table = _proc_table()
        pids = _descendants(table, args.postgres_pid) if args.postgres_pid else {
            pid for pid, (_, comm, _) in table.items() if comm == "postgres"}
        return sum(table[p][2] for p in pids if p in table)

    threads = [threading.Thread(target=drive, args=(name,)) for name in names]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    pg0, cpu0, t0 = pg_ticks(), os.times(), time.monotonic()
    measuring[0] = True
    time.sleep(args.seconds)
    measuring[0] = False
    pg1, cpu1, t1 = pg_ticks(), os.times(), time.monotonic()
    stop[0] = True
    for t in threads:
        t.join()
    c.close()
    engine.dispose()
    if errors:
        raise SystemExit(f"run failed: {errors[0]}")
    n = max(done[0], 1)
    print(json.dumps({
        "batches": done[0], "batches_per_s": done[0] / (t1 - t0),
        "pg_ms": (pg1 - pg0) / CLK_TCK * 1000 / n,
        "coord_ms": ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) * 1000 / n,
    }))


def _in_checkout(checkout: Path, code: str, *argv: str, timeout: float = 600) -> str:
    """Run Python code with the checkout's coordinator (and this file's bench/ for measure)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(BENCH)])}
    out = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=str(checkout), capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"in {checkout}: {out.stderr[-2000:]}")
    return out.stdout


_PREPARE = """
import sys
sys.path.insert(0, sys.argv[3] + "/bench")  # the checkout's own seed_history: it knows its schema
from coordinator.store.db import migrate
migrate(sys.argv[1])
from measure import seed_history
seed_history(sys.argv[1], "compare", checkpoints=int(sys.argv[2]), partitions=4, ids=int(sys.argv[2]))
"""

_RUN = "import compare_checkouts; compare_checkouts.main()"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the git revision to compare this checkout with (required unless --worker)")
    ap.add_argument("--shape", action="append", help="PARTITIONS:DRIVERS, repeatable (default 2:12 and 200:1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6, help="measured seconds per run (default 6)")
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--history", type=int, default=20_000, help="committed batches seeded first (default 20,000)")
    ap.add_argument("--database-url", help="a Postgres server to create the two databases on (default: embedded)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--partitions", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--drivers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--postgres-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    if not args.base:
        ap.error("--base is required")
    shapes = [tuple(int(x) for x in s.split(":")) for s in (args.shape or ["2:12", "200:1"])]
    sys.path.insert(0, str(BENCH))
    from measure import figure_line, log, plain_url, start_embedded_postgres
    import psycopg
    from sqlalchemy.engine import make_url

    tmp = Path(tempfile.mkdtemp(prefix="compare-checkouts-"))
    worktree = tmp / "base"
    server, postgres_pid, created = None, None, []
    try:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), args.base],
                       check=True)
        if args.database_url:
            admin = make_url(args.database_url).set(drivername="postgresql+psycopg")
        else:
            server, url = start_embedded_postgres(tmp, max_connections=200)
            postgres_pid = server.get_pid()
            admin = make_url(url).set(drivername="postgresql+psycopg")
        urls = {}
        with psycopg.connect(plain_url(admin.render_as_string(hide_password=False)), autocommit=True) as conn:
            for side in ("base", "head"):
                name = f"compare_{side}_{secrets.token_hex(3)}"
                conn.execute(f'CREATE DATABASE "{name}"')
                created.append(name)
                urls[side] = admin.set(database=name).render_as_string(hide_password=False)
        checkouts = {"base": worktree, "head": ROOT}
        for side in ("base", "head"):
            log(f"{side}: migrating and seeding {args.history} batches of history")
            _in_checkout(checkouts[side], _PREPARE, urls[side], str(args.history), str(checkouts[side]))
        runs: dict[tuple[int, int, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for partitions, drivers in shapes:
                for side in ("base", "head"):
                    argv = ["--worker", "--database-url", urls[side], "--partitions", str(partitions),
                            "--drivers", str(drivers), "--seconds", str(args.seconds), "--warmup", str(args.warmup)]
                    if postgres_pid:
                        argv += ["--postgres-pid", str(postgres_pid)]
                    got = json.loads(_in_checkout(checkouts[side], _RUN, *argv).strip().splitlines()[-1])
                    runs.setdefault((partitions, drivers, side), []).append(got)
                    log(f"round {r + 1} P={partitions} D={drivers} {side}: {got['batches_per_s']:.1f} batches/s, "
                        f"Postgres {got['pg_ms']:.3f} + coordinator {got['coord_ms']:.3f} ms per batch")
        print()
        for partitions, drivers in shapes:
            med = {side: {k: statistics.median(x[k] for x in runs[(partitions, drivers, side)])
                          for k in ("pg_ms", "coord_ms", "batches_per_s")} for side in ("base", "head")}
            print(figure_line(
                f"compare P={partitions}", drivers=drivers, base=args.base,
                base_pg_ms=med["base"]["pg_ms"], head_pg_ms=med["head"]["pg_ms"],
                pg_ratio=med["head"]["pg_ms"] / med["base"]["pg_ms"],
                base_coord_ms=med["base"]["coord_ms"], head_coord_ms=med["head"]["coord_ms"],
                coord_ratio=med["head"]["coord_ms"] / med["base"]["coord_ms"],
                batches_ratio=med["head"]["batches_per_s"] / med["base"]["batches_per_s"], rounds=args.rounds,
            ))
    finally:
        if created and args.database_url:
            with psycopg.connect(plain_url(admin.render_as_string(hide_password=False)), autocommit=True) as conn:
                for name in created:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if server is not None:
            server.cleanup()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
