#!/usr/bin/env python
"""What the attempt-row layout would save Postgres per batch, measured before building it.

Today a batch writes a lease row per partition (inserted at begin, updated by the decision and by
the committed mark, with four index entries each time the update is not HOT). The layout the issue
12 prototype used keeps a batch's first-try ids and pre-commit records on its attempt row instead.
This runs one batch (begin, decision, committed mark: three transactions) both ways on the same
database, in alternating chunks, and prints Postgres' CPU per batch from /proc:

  rows              today's statements, verbatim (coordinator/store/hot_path.py, repo._FREE_IDS);
  attempt_row       the same transactions, statements and id-pool writes, but the ids in an array
                    and the records in a JSON column of the attempt row, and no lease rows (so
                    also no lease lock before the decision);
  no_pool_writes    attempt_row without the id pool's per-id updates (leased at begin, freed at the
                    mark): the ceiling of a pool whose ids a batch does not write one by one. Its
                    ids stay FREE, so it is a cost figure only, not a working protocol.

Each variant's answers are checked (every decision and mark changed what it should, and the
batches end COMMITTED). The client is psycopg with prepared statements; only Postgres' side is
compared. The database is a fresh one (on the embedded server, or created on --database-url's
server and dropped afterwards), with a seeded history so plans are those of a running deployment.

    python bench/layout_bench.py                       # P=2 and 200, ~2 min
    python bench/layout_bench.py --shapes 2 --batches 200 --rounds 3

Last lines: one per shape, e.g.
    layout P=2 rows_pg_ms=2.950 attempt_row_pg_ms=2.079 no_pool_writes_pg_ms=1.850 attempt_row_ratio=0.70 batches_per_variant=2400
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(BENCH), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

from measure import CLK_TCK, cpu_snapshot, figure_line, log, plain_url, seed_history, start_embedded_postgres  # noqa: E402

VARIANTS = ("rows", "attempt_row", "no_pool_writes")

_NEW_ATTEMPT_ROW = """
WITH a AS (
    INSERT INTO attempts (checkpoint_id, sink_id, number, generation, state, partitions, started_at, first_ids)
    VALUES (%(checkpoint_id)s, %(sink_id)s, 1, %(generation)s, 'OPEN', %(partitions)s, %(now)s,
            CAST(%(tids)s AS text[]))
    RETURNING id
), c AS (
    UPDATE checkpoints SET current_attempt = 1 WHERE id = %(checkpoint_id)s RETURNING id
), t AS (
    UPDATE transactional_ids AS t SET state = 'LEASED'
    WHERE t.transactional_id = ANY(CAST(%(tids)s AS text[])) AND t.state = 'FREE' AND %(pool_writes)s
    RETURNING 1
)
SELECT a.id, (SELECT count(*) FROM c) AS checkpoints_updated, (SELECT count(*) FROM t) AS ids_leased FROM a
"""

_DECIDE_ATTEMPT_ROW = """
WITH c AS (
    UPDATE checkpoints SET state = 'COMMITTING', decided_at = %(now)s, committed_attempt = 1
    WHERE id = %(checkpoint_id)s AND state = 'OPEN' RETURNING id
), a AS (
    UPDATE attempts SET state = 'COMMITTING', decided_at = %(now)s, partitions = %(partitions)s,
        records = CAST(%(records)s AS jsonb)
    WHERE id = %(attempt_id)s AND state = 'OPEN' RETURNING id
), ev AS (
    INSERT INTO events (sink_id, checkpoint_id, at, kind, actor, detail)
    SELECT %(sink_id)s, %(checkpoint_id)s, %(now)s, 'commit_decided', 'layout_bench', CAST(%(detail)s AS jsonb)
    FROM c, a
)
SELECT c.id AS checkpoint_id, a.id AS attempt_id FROM c CROSS JOIN a
"""

_MARK_ATTEMPT_ROW = """
WITH a AS (
    UPDATE attempts SET state = 'COMMITTED', finished_at = %(now)s
    WHERE id = %(attempt_id)s AND state = 'COMMITTING' RETURNING id, first_ids
), c AS (
    UPDATE checkpoints SET state = 'COMMITTED', committed_at = %(now)s
    WHERE id = %(checkpoint_id)s AND state = 'COMMITTING' AND EXISTS (SELECT 1 FROM a) RETURNING id
), t AS (
    UPDATE transactional_ids AS t SET state = 'FREE', released_at = %(now)s, reusable_at = NULL
    FROM a WHERE t.transactional_id = ANY(a.first_ids) AND t.state = 'LEASED' AND %(pool_writes)s
    RETURNING 1
)
SELECT c.id, (SELECT count(*) FROM t) AS ids_freed FROM c CROSS JOIN a
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", help="a Postgres server to create the throwaway database on (default: embedded)")
    ap.add_argument("--shapes", default="2,200", help="partitions per batch, comma-separated (default 2,200)")
    ap.add_argument("--batches", type=int, default=400, help="batches per chunk at P=2; fewer for larger P (default 400)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds of one chunk per variant (default 6)")
    ap.add_argument("--history", type=int, default=20000, help="committed batches seeded first (default 20000)")
    return ap.parse_args(argv)


class Layouts:
    """One sink per (shape, variant) and the statements of one batch in each variant."""

    def __init__(self, url: str, shapes: list[int]) -> None:
        import psycopg

        from coordinator.kafka.control_plane import RecordingControlPlane
        from coordinator.service import Coordinator
        from coordinator.store.db import make_engine
        from protocol_clients import InprocessSink, Record, register_inprocess

        self.names = {(p, v): f"layout-{p:03d}-{v}" for p in shapes for v in VARIANTS}
        self.next_batch = dict.fromkeys(self.names, 1)
        register_inprocess(url, list(self.names.values()))
        engine = make_engine(url, pool_size=2)
        coordinator = Coordinator(engine, RecordingControlPlane(keep_history=False))
        try:
            for (partitions, _), name in self.names.items():  # batch 0 grows each sink's pool to P ids
                sink = InprocessSink(coordinator, name)
                generation = sink.start_generation("q", "r")
                begun = sink.begin(0, generation, partitions)
                winners = sorted(begun.pre_leases)
                sink.commit(0, begun.attempt, generation, winners, [Record(1, 1, 1, [["t", 0, 1]]) for _ in winners])
        finally:
            coordinator.close()
            engine.dispose()
        self.conn = psycopg.connect(plain_url(url))
        self.conn.execute("ALTER TABLE attempts ADD COLUMN first_ids text[], ADD COLUMN records jsonb")
        self.conn.commit()

    def _run(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        cur = self.conn.execute(sql, params, prepare=True)
        if cur.description is None:
            return []
        names = [d.name for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]

    def batch(self, partitions: int, variant: str) -> None:
        from coordinator.store import hot_path, repo

        name = self.names[(partitions, variant)]
        batch_id = self.next_batch[(partitions, variant)]
        self.next_batch[(partitions, variant)] += 1
        # begin: the sink, the clock and a new checkpoint; free ids; the attempt
        head = self._run(hot_path._BEGIN_HEAD.sql, {"name": name, "batch_id": batch_id, "now": None,
                                                    "offsets_digest": None})[0]
        sink_id, checkpoint_id, now = head["s_id"], head["c_id"], head["db_now"]
        assert head["inserted"], head
        free = self._run(repo._FREE_IDS.sql, {"sink_id": sink_id, "now": now, "n": partitions})
        tids = [r["transactional_id"] for r in free]
        assert len(tids) == partitions, f"{name}: {len(tids)} free ids for {partitions} partitions"
        pool_writes = variant != "no_pool_writes"
        common = {"checkpoint_id": checkpoint_id, "sink_id": sink_id, "partitions": partitions, "now": now}
        if variant == "rows":
            rows = self._run(hot_path._NEW_ATTEMPT.sql, {
                **common, "number": 1, "generation": head["s_generation"], "task_attempt_id": 0,
                "lease_partitions": list(range(partitions)), "tids": tids, "deadline_at": now,
            })
            attempt_id = rows[0]["a_id"]
            lease_ids = [r["l_id"] for r in rows if r["l_id"] is not None]
            assert len(lease_ids) == partitions and rows[0]["checkpoints_updated"] == 1
        else:
            (made,) = self._run(_NEW_ATTEMPT_ROW, {**common, "generation": head["s_generation"], "tids": tids,
                                                  "pool_writes": pool_writes})
            attempt_id = made["id"]
            assert made["checkpoints_updated"] == 1 and made["ids_leased"] == (partitions if pool_writes else 0), made
        self.conn.commit()
        # the decision
        assert self._run(hot_path._COMMIT_HEAD.sql, {"name": name, "batch_id": batch_id, "number": 1})
        detail = json.dumps({"batch_id": batch_id, "attempt": 1, "winners": [[p, p, t] for p, t in enumerate(tids)]})
        records = [{"producer_id": 1000 + p, "producer_epoch": 0, "records": 10, "bytes": 5, "write_ms": 3,
                    "first_offsets": [["bench", k, 10 * batch_id] for k in range(8)]}  # as the writer sends them
                   for p in range(partitions)]
        if variant == "rows":
            assert len(self._run(hot_path._LOCK_ATTEMPT_LEASES.sql, {"attempt_id": attempt_id})) == partitions
            decided = self._run(hot_path._DECIDE.sql, {
                **common, "attempt_id": attempt_id, "number": 1, "job_ms": 1, "actor": "layout_bench",
                "detail": detail, "ids": lease_ids,
                "records": json.dumps({lease: r for lease, r in zip(lease_ids, records)}),
            })
            assert decided[0]["c_id"] is not None and sum(r["w_id"] is not None for r in decided) == partitions
        else:
            decided = self._run(_DECIDE_ATTEMPT_ROW, {**common, "attempt_id": attempt_id, "detail": detail,
                                                      "records": json.dumps(records)})
            assert len(decided) == 1, decided
        self.conn.commit()
        # the committed mark
        self._run(hot_path._LOCK_CHECKPOINT_FOR_MARK.sql, {"checkpoint_id": checkpoint_id})
        if variant == "rows":
            marked = self._run(hot_path._MARK_COMMITTED.sql, {
                "sink_id": sink_id, "checkpoint_id": checkpoint_id, "attempt_id": attempt_id, "done": lease_ids,
                "done_ids": tids, "now": now, "finish": True, "event_actor": None, "detail": "{}",
            })
            assert marked[0]["c_id"] is not None, "the rows layout's mark did not finish the checkpoint"
        else:
            (marked,) = self._run(_MARK_ATTEMPT_ROW, {"attempt_id": attempt_id, "checkpoint_id": checkpoint_id,
                                                      "now": now, "pool_writes": pool_writes})
            assert marked["ids_freed"] == (partitions if pool_writes else 0), marked
        self.conn.commit()

    def check_all_committed(self) -> None:
        """Every batch of every variant ended COMMITTED, and no id of theirs is left LEASED."""
        open_ = self.conn.execute(
            "SELECT count(*) FROM checkpoints c JOIN sinks s ON s.id = c.sink_id "
            "WHERE s.name = ANY(%s) AND c.state <> 'COMMITTED'", [list(self.names.values())]).fetchone()
        leased = self.conn.execute(
            "SELECT count(*) FROM transactional_ids t JOIN sinks s ON s.id = t.sink_id "
            "WHERE s.name = ANY(%s) AND t.state <> 'FREE'", [list(self.names.values())]).fetchone()
        self.conn.rollback()
        if open_[0] or leased[0]:
            raise AssertionError(f"{open_[0]} checkpoints not COMMITTED, {leased[0]} ids not FREE")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = [int(x) for x in args.shapes.split(",")]
    import psycopg
    from sqlalchemy.engine import make_url

    from coordinator.store.db import migrate

    server_pg, dropped = None, None
    if args.database_url:
        db = "layout_" + secrets.token_hex(4)
        with psycopg.connect(plain_url(args.database_url), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{db}"')
        url = make_url(args.database_url).set(database=db).render_as_string(hide_password=False)
        dropped = db
        postgres_pid = None  # every process named postgres on this machine
    else:
        tmp = Path(tempfile.mkdtemp(prefix="layout-bench-"))
        tmp.chmod(0o755)  # the embedded server runs as user pgserver when we are root
        log(f"starting an embedded Postgres in {tmp}")
        server_pg, url = start_embedded_postgres(tmp, 40)
        postgres_pid = server_pg.get_pid()
    lines = []
    try:
        migrate(url)
        if args.history:
            log(f"seeding a history of {args.history} committed batches (then VACUUM ANALYZE)")
            seed_history(url, "layout", args.history, ids=2 * args.history)
        layouts = Layouts(url, shapes)
        for partitions in shapes:
            per_chunk = max(4, args.batches * 10 // partitions) if partitions > 2 else args.batches
            for variant in VARIANTS:  # warm up: prepared statements, caches
                for _ in range(max(2, per_chunk // 4)):
                    layouts.batch(partitions, variant)
            pg_seconds = dict.fromkeys(VARIANTS, 0.0)
            batches = dict.fromkeys(VARIANTS, 0)
            for r in range(args.rounds):
                for variant in VARIANTS:
                    before = cpu_snapshot(None, postgres_pid)
                    for _ in range(per_chunk):
                        layouts.batch(partitions, variant)
                    after = cpu_snapshot(None, postgres_pid)
                    pg_seconds[variant] += (after["postgres"] - before["postgres"]) / CLK_TCK
                    batches[variant] += per_chunk
                log(f"  P={partitions}: round {r + 1}/{args.rounds} done")
            ms = {v: 1000 * pg_seconds[v] / batches[v] for v in VARIANTS}
            lines.append(figure_line(
                f"layout P={partitions}", rows_pg_ms=f"{ms['rows']:.3f}", attempt_row_pg_ms=f"{ms['attempt_row']:.3f}",
                no_pool_writes_pg_ms=f"{ms['no_pool_writes']:.3f}",
                attempt_row_ratio=f"{ms['attempt_row'] / ms['rows']:.2f}" if ms["rows"] else "-",
                batches_per_variant=batches["rows"],
            ))
        layouts.check_all_committed()
        layouts.conn.close()
    finally:
        if dropped:
            with psycopg.connect(plain_url(args.database_url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{dropped}" WITH (FORCE)')
        if server_pg is not None:
            server_pg.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
