"""Pruning the history (coordinator/service/history.py): what it frees, what it costs, and whether
the space is used again.

```bash
python bench/prune_bench.py                                   # 100 batches of 200 partitions (~2 min)
python bench/prune_bench.py --partitions 2 --batches 5000
```

On a throwaway Postgres, in process: N committed batches of P partitions (each task's record
with the first offsets the writer reports, FIRST_OFFSETS_KEPT), their commit times moved two hours back,
then pruned in chunks of `--chunk` batches through `Coordinator.prune_history`; then N more batches
on the freed space, and every batch but the newest pruned. Printed: the tables' size per batch (`pg_total_relation_size`: heap, indexes
and TOAST) before, after pruning and VACUUM (the files keep their size; the space is free inside
them), how much the second N batches grew them (near 0 when the freed space is used again), and
after VACUUM FULL (what a pruned batch still takes: its checkpoint row); the pruning's wall time
per chunk and its CPU per batch pruned, Postgres' and this process's, from /proc.

Last line: `prune P=… batches=… bytes_per_batch=… kept_bytes_per_batch=… regrowth_bytes_per_batch=…
postgres_cpu_ms_per_batch=… coordinator_cpu_ms_per_batch=… chunk_p50_ms=…`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import (  # noqa: E402
    cpu_seconds,
    cpu_snapshot,
    figure_line,
    log,
    percentile,
    plain_url,
    start_embedded_postgres,
)

TABLES = ("checkpoints", "attempts", "leases", "events")


def sizes(url: str, *, vacuum: str | None = None) -> dict[str, int]:
    import psycopg

    with psycopg.connect(plain_url(url), autocommit=True) as conn:
        if vacuum is not None:
            conn.execute(f"VACUUM {vacuum}")
        conn.execute("CHECKPOINT")
        rows = conn.execute("SELECT relname, pg_total_relation_size(oid) FROM pg_class WHERE relname = ANY(%s)",
                            (list(TABLES),)).fetchall()
    return dict(rows)


def per_batch(a: dict[str, int], b: dict[str, int], n: int) -> dict[str, int]:
    return {t: round((b[t] - a.get(t, 0)) / n) for t in TABLES}


def run_batches(c: Any, name: str, gen: int, first: int, n: int, partitions: int) -> None:
    from coordinator.protocol.model import FIRST_OFFSETS_KEPT, PartitionResult, PrecommitRecord

    for b in range(first, first + n):
        attempt = c.begin_checkpoint(name, b, gen, "bench", partitions=partitions).attempt.number
        # each partition's first try claims its pre-lease; its record as the writer sends it
        won = [c.lease(name, b, attempt, gen, p, b * partitions + p).lease for p in range(partitions)]
        results = [PartitionResult(x.partition, x.id, PrecommitRecord(
            x.task_attempt_id, 1000 + x.partition, 0, 10, 1000, 5,
            [["bench", k, 10 * b] for k in range(FIRST_OFFSETS_KEPT)])) for x in won]
        c.commit(name, b, attempt, gen, results, "bench")
        if (b - first + 1) % max(1, n // 5) == 0:
            log(f"  {b - first + 1} of {n} batches")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=int, default=200)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--chunk", type=int, default=25, help="batches per pruning transaction (25)")
    args = ap.parse_args()

    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Coordinator, Limits, SinkSpec
    from coordinator.store.db import make_engine, migrate

    tmp = Path(tempfile.mkdtemp(prefix="prune-bench-"))
    os.chmod(tmp, 0o755)  # the embedded server runs as user pgserver when we are root
    server, url = start_embedded_postgres(tmp, 20)
    pg_pid = server.get_pid()
    try:
        migrate(url)
        engine = make_engine(url, pool_size=2)
        c = Coordinator(engine, RecordingControlPlane(keep_history=False),
                        limits=Limits(max_partitions=max(args.partitions, 1)))
        name = "bench-prune"
        c.register_sink(SinkSpec(name, "tx-bench-prune", "localhost:9092", ["bench"]), "bench")
        gen, _ = c.start_generation(name, "q", "r", "bench")
        n, p = args.batches, args.partitions
        log(f"{n} batches of {p} partitions")
        run_batches(c, name, gen, 0, n, p)
        s0 = sizes(url, vacuum="ANALYZE")

        def backdate() -> None:
            with engine.begin() as conn:
                conn.exec_driver_sql("UPDATE checkpoints SET committed_at = committed_at - interval '2 hours' "
                                     "WHERE history_pruned_at IS NULL")

        def prune_all() -> tuple[int, list[float]]:
            pruned, chunks = 0, []
            while True:
                t0 = time.monotonic()
                outcome = c.prune_history(timedelta(hours=1), "bench", limit=args.chunk)
                chunks.append((time.monotonic() - t0) * 1000)
                pruned += outcome.pruned
                if not outcome.more:
                    return pruned, chunks

        backdate()
        log(f"pruning in chunks of {args.chunk}")
        a = cpu_snapshot(None, pg_pid)
        pruned, chunks = prune_all()
        cpu = cpu_seconds(a, cpu_snapshot(None, pg_pid))
        s1 = sizes(url, vacuum="")
        log(f"{n} more batches on the freed space")
        run_batches(c, name, gen, n, n, p)
        s2 = sizes(url, vacuum="")
        backdate()
        pruned_too, _ = prune_all()  # every batch but the newest, for what a pruned one keeps
        s3 = sizes(url, vacuum="FULL")
        c.close()
        engine.dispose()

        before, regrowth = per_batch({}, s0, n), per_batch(s1, s2, n)
        whole = sum(before.values())
        kept = (sum(s3.values()) - whole) / (pruned + pruned_too)  # the newest batch is kept whole
        print(f"tables per batch before pruning (bytes): {before} = {whole}")
        print(f"after pruning {pruned} and VACUUM, the files: {s1} (the same size: the space is free inside them)")
        print(f"growth per batch of the next {n} batches: {regrowth} = {sum(regrowth.values())}")
        print(f"after pruning all but the newest and VACUUM FULL: {s3}, ~{kept:.0f} bytes per pruned batch")
        print(f"chunks: {len(chunks)} of <= {args.chunk} batches, p50 {percentile(chunks, 50):.1f} ms, "
              f"max {max(chunks):.1f} ms")
        print(figure_line(
            f"prune P={p}", batches=pruned, bytes_per_batch=whole, kept_bytes_per_batch=round(kept),
            regrowth_bytes_per_batch=sum(regrowth.values()),
            postgres_cpu_ms_per_batch=round(cpu["postgres"] * 1000 / max(pruned, 1), 3),
            coordinator_cpu_ms_per_batch=round(cpu["bench"] * 1000 / max(pruned, 1), 3),
            chunk_p50_ms=round(percentile(chunks, 50) or 0, 1)))
    finally:
        server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
