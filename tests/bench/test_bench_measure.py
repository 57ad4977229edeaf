"""bench/measure.py counts what it claims to: figure lines parse back, percentiles, CPU charged to the
process that used it, SQL statements and round trips from the engine's hooks, the floor's
committed updates, and a seeded history that is a state the coordinator could be in."""

from __future__ import annotations

import subprocess
import sys
import time

import psycopg
from sqlalchemy import Engine, text

from fixtures.servers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import measure  # noqa: E402


def test_figure_lines_parse_back() -> None:
    line = measure.figure_line("P=2 http", batches_per_s=1234.5, cpu_ms_per_batch=1.234, calls_per_batch=2.0,
                               p99_ms=None, errors=0)
    assert line == "P=2 http batches_per_s=1234 cpu_ms_per_batch=1.23 calls_per_batch=2.00 p99_ms=- errors=0"
    assert measure.parse_figure_line(line) == (
        "P=2 http", {"batches_per_s": "1234", "cpu_ms_per_batch": "1.23", "calls_per_batch": "2.00", "p99_ms": "-",
                     "errors": "0"})


def test_percentile_picks_the_nearest_rank() -> None:
    values = [float(x) for x in range(1, 101)]
    assert measure.percentile(values, 50) == 51.0
    assert measure.percentile(values, 99) == 99.0
    assert measure.percentile([], 99) is None


def test_cpu_snapshot_charges_a_busy_process_to_the_party_it_is_named_for() -> None:
    """A child that spins for 0.8 s of CPU, named the server (then the broker): its CPU shows
    there, however long a busy machine takes to give it that much; an idle child (the broken
    variant: nothing to count) shows about none."""
    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.8: pass\nprint('done', flush=True)\ntime.sleep(30)"
    idle = "import time\ntime.sleep(0.5)\nprint('done', flush=True)\ntime.sleep(30)"
    charged = {}
    for name, code, party in (("spin", spin, "server"), ("idle", idle, "server"), ("broker", spin, "broker")):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        pids = {"server_pid": proc.pid, "postgres_pid": None} if party == "server" else \
            {"server_pid": None, "postgres_pid": None, "broker_pid": proc.pid}
        try:
            a, t0 = measure.cpu_snapshot(**pids), time.monotonic()
            assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
            b, wall = measure.cpu_snapshot(**pids), time.monotonic() - t0
            used = measure.cpu_delta(a, b, wall)
            charged[name] = used[party] * wall
            if name == "broker":
                assert used["server"] == 0 and used["bench"] * wall < 0.15, used  # not charged twice
        finally:
            proc.kill()
            proc.wait(timeout=10)
    assert charged["spin"] >= 0.5 and charged["broker"] >= 0.5, charged
    assert charged["idle"] < 0.15, charged


def test_sql_counter_counts_statements_checkouts_and_round_trips(engine: Engine) -> None:
    counter = measure.SqlCounter(engine)
    with engine.begin() as conn:  # BEGIN, 2 statements, COMMIT
        conn.execute(text("SELECT 1"))
        conn.execute(text("SELECT 2"))
    with engine.connect() as conn:  # BEGIN, a statement, the ROLLBACK of close
        conn.execute(text("SELECT 3"))
    assert (counter.statements, counter.checkouts, counter.round_trips()) == (3, 2, 7)
    counter.reset()
    assert (counter.statements, counter.checkouts, counter.round_trips()) == (0, 0, 0)


def test_floor_measures_committed_updates(database_url: str) -> None:
    figures = measure.floor(database_url, 0.3, 1)
    with psycopg.connect(measure.plain_url(database_url)) as conn:
        done = conn.execute("SELECT sum(n) FROM bench_floor").fetchone()[0]
    # the rate is what was committed: the rows' counters agree with it
    assert done > 0 and figures["update_tx_per_s"] > 0
    assert abs(int(done) - figures["update_tx_per_s"] * 0.3) <= 0.5 * int(done) + 5


def test_seeded_history_is_committed_batches_of_retired_sinks_that_break_no_invariant(
    database_url: str, engine: Engine
) -> None:
    """The history the benchmarks seed is a state the coordinator could be in: the invariant
    checker finds nothing on it, and finds the same rows with one lease left unresolved on the
    retired sink (the broken variant: a seed the checker would have to refuse)."""
    from coordinator.protocol.invariants import check_invariants
    from coordinator.store.snapshot import snapshot

    measure.seed_history(database_url, "t1", checkpoints=50, partitions=3, ids=20)
    with psycopg.connect(measure.plain_url(database_url), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM sinks WHERE retired_at IS NOT NULL").fetchone() == (2,)
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM checkpoints WHERE state = 'COMMITTED'), "
            "(SELECT count(*) FROM attempts WHERE state = 'COMMITTED'), "
            "(SELECT count(*) FROM leases WHERE state = 'COMMITTED' AND resolved_at IS NOT NULL), "
            "(SELECT count(*) FROM events), (SELECT count(*) FROM quarantined_ids), "
            "(SELECT sum(size) FROM id_pools)").fetchone()
        assert counts == (50, 50, 150, 50, 2, 23)
        # every table's statistics now describe its rows (the planner's view of a running deployment)
        stats = dict(conn.execute("SELECT relname, reltuples FROM pg_class WHERE relname IN "
                                  "('checkpoints', 'attempts', 'leases', 'events')").fetchall())
        assert stats == {"checkpoints": 50, "attempts": 50, "leases": 150, "events": 50}
    with engine.connect() as conn:
        assert check_invariants(snapshot(conn), settled=True) == []
    with psycopg.connect(measure.plain_url(database_url), autocommit=True) as conn:
        conn.execute("UPDATE leases SET state = 'LEASED', resolved_at = NULL "
                     "WHERE id = (SELECT max(id) FROM leases)")
    with engine.connect() as conn:
        assert check_invariants(snapshot(conn), settled=True) != []
