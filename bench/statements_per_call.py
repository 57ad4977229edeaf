#!/usr/bin/env python
"""Where a batch's statements go, call by call: one driver in process on a throwaway Postgres runs
batches (begin with the partition count, a lease per partition, commit with every winner's
record) and counts, for one batch after a few unmeasured ones, each call's SQL statements,
Postgres transactions and separate clock reads, from SQLAlchemy's hooks (every statement of the
coordinator goes through them). With --show, each statement's first words too.

    python bench/statements_per_call.py                 # P=2 and P=200
    python bench/statements_per_call.py --partitions 2 --show

One line per call and shape: `statements P=… call=… statements=… transactions=… clock_reads=…`
(lease: all P calls together), then `statements P=… call=batch …`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
if str(BENCH.parent) not in sys.path:
    sys.path.append(str(BENCH.parent))

from measure import figure_line, start_embedded_postgres  # noqa: E402
from protocol_clients import InprocessSink, Record  # noqa: E402

CALLS = ("begin", "lease", "commit")


def count_batch(url: str, partitions: int, show: bool) -> dict[str, Counter[str]]:
    from sqlalchemy import event

    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Coordinator, Limits, SinkSpec
    from coordinator.store.db import make_engine

    engine = make_engine(url, pool_size=2)
    c = Coordinator(engine, RecordingControlPlane(keep_history=False), limits=Limits(max_partitions=max(256, partitions)))
    name = f"statements-{partitions}p"
    c.register_sink(SinkSpec(name, f"tx-{name}", "localhost:9092", ["out"]), "bench")
    sink = InprocessSink(c, name)
    generation = sink.start_generation("q", "r")
    counts: dict[str, Counter[str]] = {k: Counter() for k in CALLS}
    current: list[str | None] = [None]

    def statement(conn: Any, cursor: Any, sql: str, *_: Any) -> None:
        call = current[0]
        if call is None:
            return
        counts[call]["statements"] += 1
        if conn.connection.driver_connection.pgconn.transaction_status == 0:  # idle: this one begins a transaction
            counts[call]["transactions"] += 1
        if "clock_timestamp()" in sql and sql.lstrip().upper().startswith("SELECT CLOCK_TIMESTAMP()"):
            counts[call]["clock_reads"] += 1
        if show:
            print(f"  {call:<7}{' '.join(sql.split())[:110]}")

    def batch(batch_id: int) -> None:
        current[0] = "begin"
        attempt = sink.begin(batch_id, generation, partitions).attempt
        assert attempt is not None
        current[0] = "lease"
        won = [sink.lease(batch_id, attempt, generation, p, batch_id * partitions + p)[0] for p in range(partitions)]
        current[0] = "commit"
        if sink.commit(batch_id, attempt, generation, list(enumerate(won)),
                       [Record(batch_id * partitions + p, 1000 + p, 0, 10) for p in range(partitions)]) != partitions:
            raise RuntimeError(f"batch {batch_id} did not commit")
        current[0] = None

    try:
        for b in range(3):  # the pool grows, statements are prepared: not the steady state
            batch(b)
        event.listen(engine, "before_cursor_execute", statement)
        batch(3)
    finally:
        c.close()
        engine.dispose()
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", type=int, nargs="+", default=[2, 200])
    ap.add_argument("--show", action="store_true", help="print each statement's first words")
    ap.add_argument("--database-url", help="an empty Postgres database to use instead of an embedded one")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="statements-per-call-"))
    os.chmod(tmp, 0o755)
    pg = None
    try:
        if args.database_url:
            url = args.database_url
        else:
            pg, url = start_embedded_postgres(tmp, 20)
        from coordinator.store.db import migrate

        migrate(url)
        lines = []
        for p in args.partitions:
            counts = count_batch(url, p, args.show)
            for call in CALLS:
                lines.append(figure_line(f"statements P={p}", call=call, **{k: counts[call][k] for k in (
                    "statements", "transactions", "clock_reads")}))
            total = sum(counts.values(), Counter())
            lines.append(figure_line(f"statements P={p}", call="batch", **{k: total[k] for k in (
                "statements", "transactions", "clock_reads")}))
    finally:
        if pg is not None:
            pg.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
