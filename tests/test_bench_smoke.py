"""The benchmarks still run: protocol_bench for a second per mode on the test's Postgres (real
`coordinator serve` over HTTP too), printing its figure lines; and the measuring code in
bench/measure.py counts what it claims to (CPU from /proc, SQL statements from the engine's hooks).
No speed is asserted here: figures are the benchmark's business."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from fixtures.servers import REPO_ROOT, clean_env

BENCH = REPO_ROOT / "bench"
sys.path.insert(0, str(BENCH))

import measure  # noqa: E402


def test_protocol_bench_runs_both_modes_and_prints_its_figure_lines(database_url: str, tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH / "protocol_bench.py"), "--database-url", database_url, "--seconds", "1",
           "--warmup", "0.5", "--shape", "2:1", "--procs", "1", "--workers", "1", "--floor-seconds", "0.5",
           "--floor-threads", "2", "--history", "300", "--json", str(tmp_path / "out.json")]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    figures = dict(measure.parse_figure_line(line) for line in lines if "=" in line and not line.startswith("["))
    assert float(figures["floor"]["update_tx_per_s"]) > 0
    assert float(figures["floor"]["select1_per_s"]) > 0
    assert all(float(v) > 0 for v in figures["statement_cost"].values()) and len(figures["statement_cost"]) == 4
    for run in ("P=2 inprocess", "P=2 http"):
        f = figures[run]
        assert float(f["batches_per_s"]) > 0, f
        assert float(f["cpu_ms_per_batch"]) > 0, f
        assert float(f["p99_ms"]) > 0, f
        assert f["errors"] == "0", f
        assert float(figures[f"ratio {run}"]["floor_tx_per_batch"]) > 0
    # the same load against the stack floor's bare server, and the coordinator's ratio to it
    f = figures["P=2 stack-floor"]
    assert float(f["batches_per_s"]) > 0 and float(f["cpu_ms_per_batch"]) > 0 and f["errors"] == "0", f
    assert f["calls_per_batch"] == figures["P=2 http"]["calls_per_batch"]
    ratio = figures["ratio P=2 http/stack-floor"]
    assert all(float(ratio[k]) > 0 for k in ("cpu_per_batch", "coordinator_cpu", "postgres_cpu", "batches_per_s")), ratio
    assert "COMMITTED batches of the floor" in out.stdout
    # both clients make the same protocol calls; in process the engine's hooks count statements
    assert figures["P=2 inprocess"]["calls_per_batch"] == figures["P=2 http"]["calls_per_batch"]
    assert float(figures["P=2 inprocess"]["statements_per_batch"]) >= float(figures["P=2 inprocess"]["calls_per_batch"])
    assert lines[-1].startswith("P=2 http batches_per_s=")
    assert "record check: ok" in out.stdout and "MISMATCH" not in out.stdout


def test_stack_floor_serves_the_benchmarks_load_and_its_record_check_sees_what_it_wrote(
    database_url: str, tmp_path: Path
) -> None:
    """The floor's server answers the load's calls as the coordinator does, writes each batch
    COMMITTED, and refuses what is not its one happy path; its record check fails on a batch left
    undecided and on a batch the drivers saw complete that it did not write."""
    import stack_floor
    from protocol_clients import HttpSink, Rejected

    url = measure.plain_url(database_url)
    stack_floor.create_schema(url)
    (sink,) = stack_floor.register(url, ["floor-a"], 3)
    server = stack_floor.FloorServer(url, 1, 2, tmp_path / "floor.log")
    try:
        client = HttpSink(server.base_url, sink["name"], sink["token"])
        assert client.pre_leases
        generation = client.start_generation("q", "r")
        (late,) = stack_floor.register(url, ["floor-b"], 1)  # registered once the server has answered
        assert HttpSink(server.base_url, late["name"], late["token"]).start_generation("q", "r") == 1
        for batch in range(3):
            begun = client.begin(batch, generation, 3)
            assert begun.attempt == 1 and sorted(p for p, _ in begun.pre_leases) == [0, 1, 2]
            assert client.commit(batch, 1, generation, sorted(begun.pre_leases)) == 3
        with pytest.raises(Rejected):  # a batch of another generation
            client.begin(3, generation + 1, 3)
        with pytest.raises(Rejected):  # a replayed batch: not new
            client.begin(0, generation, 3)
        with pytest.raises(Rejected):
            HttpSink(server.base_url, sink["name"], "not-the-token").begin(3, generation, 3)
        begun = client.begin(3, generation, 3)  # left undecided
        client.close()
    finally:
        server.stop()
    assert stack_floor.check_record(url, ["floor-a"], 3)["ok"] is False  # batch 3 is OPEN
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM stack_floor.batches WHERE batch_id = 3")
    assert stack_floor.check_record(url, ["floor-a"], 3) == {
        "committed_batches": 3, "cycles_completed_by_drivers": 3, "batches_not_committed": 0, "ok": True}
    assert stack_floor.check_record(url, ["floor-a"], 4)["ok"] is False  # a completed batch it never wrote


def test_protocol_bench_paces_its_drivers_to_the_rate_asked(database_url: str) -> None:
    # unpaced, one in-process driver runs hundreds of two-partition batches a second here; paced at
    # 10/s over 2 drivers, a 2-second window holds ~20 (each driver's in-flight batch at the edges
    # may add one)
    cmd = [sys.executable, str(BENCH / "protocol_bench.py"), "--database-url", database_url, "--mode", "inprocess",
           "--seconds", "2", "--warmup", "0.5", "--shape", "2:2", "--procs", "1", "--rate", "10",
           "--floor-seconds", "0", "--history", "0"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = measure.parse_figure_line(out.stdout.strip().splitlines()[-1])[1]
    assert figures["target_batches_per_s"] == "10.0", figures
    assert 1 <= float(figures["batches_per_s"]) * 2 <= 22, figures
    assert "paced: 10 batches/s asked" in out.stdout


def test_statement_times_names_each_statement_of_a_batch_with_its_times() -> None:
    """bench/statement_times.py on its own Postgres: every statement of a batch by its Python name
    (none left as bare SQL), each of the common path's once per batch, with times."""
    cmd = [sys.executable, str(BENCH / "statement_times.py"), "--partitions", "3", "--batches", "6", "--warmup", "2"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = [measure.parse_figure_line(line) for line in out.stdout.splitlines() if line.startswith("statement")]
    statements = {f["name"]: f for label, f in figures if label == "statement P=3"}
    once = ("hot_path._BEGIN_NEW_BATCH", "hot_path._DECIDE_FIRST_TRIES",
            "hot_path._LOCK_CHECKPOINT_FOR_MARK", "hot_path._MARK_FIRST_TRIES_COMMITTED")
    for name in once:
        assert statements[name]["per_batch"] == "1.00", (name, statements)
        assert float(statements[name]["execute_p50_us"]) > 0 and float(statements[name]["execute_p90_us"]) > 0
    # what is not a driver statement is a transaction's own command, named by its text
    others = set(statements) - set(once)
    assert all(n.split("_")[0] in ("BEGIN", "COMMIT", "SET") for n in others), others
    (summary,) = [f for label, f in figures if label == "statements P=3"]
    assert summary["batches"] == "6" and float(summary["postgres_cpu_ms_per_batch"]) >= 0
    assert float(summary["logged_ms_per_batch"]) > 0


def test_prune_bench_prunes_all_but_the_newest_and_measures_the_space() -> None:
    """bench/prune_bench.py on its own Postgres: the batches are pruned (all but the newest), a
    pruned batch keeps less than a whole one, and the figures are there."""
    cmd = [sys.executable, str(BENCH / "prune_bench.py"), "--partitions", "20", "--batches", "40", "--chunk", "15"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (label, f), = [measure.parse_figure_line(line) for line in out.stdout.splitlines() if line.startswith("prune P=")]
    assert label == "prune P=20" and f["batches"] == "39"
    assert 0 < int(f["kept_bytes_per_batch"]) < int(f["bytes_per_batch"])
    assert float(f["postgres_cpu_ms_per_batch"]) >= 0 and float(f["chunk_p50_ms"]) > 0
    assert "chunks: 3 of <= 15 batches" in out.stdout


def test_statement_times_reads_a_statement_logged_over_several_lines() -> None:
    import statement_times

    known = {"WITH a AS ( SELECT $1 ) SELECT * FROM a": "hot_path.X"}
    text = ("2026-11-28 01:00:00.000 UTC [7] LOG:  duration: 0.250 ms  bind driver_sql_3: WITH a AS (\n"
            "    SELECT $1\n) SELECT * FROM a\n"
            "2026-11-28 01:00:00.001 UTC [7] LOG:  duration: 1.500 ms  execute driver_sql_3: WITH a AS (\n"
            "    SELECT $1\n) SELECT * FROM a\n"
            "2026-11-28 01:00:00.002 UTC [7] LOG:  duration: 0.010 ms  execute <unnamed>: BEGIN\n"
            "2026-11-28 01:00:00.003 UTC [7] LOG:  duration: 0.090 ms  execute <unnamed>: COMMIT\n"
            "2026-11-28 01:00:00.004 UTC [7] LOG:  duration: 1.000 ms  execute driver_sql_3: WITH a AS (\n"
            "    SELECT $1\n) SELECT * FROM a\n")
    assert statement_times.parse_log(text, known) == {
        "hot_path.X": {"bind": [0.25], "execute": [1.5, 1.0]}, "BEGIN": {"execute": [0.01]}, "COMMIT": {"execute": [0.09]}}


@pytest.mark.real_kafka
@pytest.mark.slow
@pytest.mark.timeout(900)  # two JVMs (broker, Spark) and three paths: ~2 min idle, 5 on a loaded machine
def test_writer_bench_runs_every_path_on_a_real_broker() -> None:
    """A tiny run of bench/writer_bench.py as a user starts it (its own Kafka via localkafka, its own
    `coordinator serve`): a figure line per path, shape and round with every party's CPU (every
    record visible to read_committed, or the bench exits non-zero), a median per path, the small
    batches of every path, the ratios last."""
    cmd = [sys.executable, str(BENCH / "writer_bench.py"), "--batches", "2", "--records-per-batch", "500",
           "--rounds", "1", "--shapes", "bench", "--small-batches", "2", "--small-partitions", "4"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "=" in line]
    figures = dict(measure.parse_figure_line(line) for line in lines)
    for path in ("spark-kafka-sink", "native-sink", "foreach-batch"):
        f = figures[f"round 1 bench {path}"]
        assert f["records"] == f["visible"] == "1000", f
        assert float(f["records_per_s"]) > 0 and float(f["cpu_us_per_record"]) > 0, f
        assert float(figures[f"path {path} bench"]["records_per_s"]) > 0
    assert float(figures["round 1 bench spark-kafka-sink"]["spark_jvm_cpu_s"]) > 0
    for path in ("native-sink", "foreach-batch"):  # the coordinator's and the Python workers' shares are counted
        assert float(figures[f"round 1 bench {path}"]["coordinator_cpu_s"]) > 0
        assert float(figures[f"round 1 bench {path}"]["python_workers_cpu_s"]) > 0
    for path in ("spark-kafka-sink", "native-sink", "foreach-batch", "foreach-batch-per-partition"):
        assert float(figures[f"small P=4 {path}"]["wall_ms_p50"]) > 0
    label, ratio = measure.parse_figure_line(lines[-1])
    assert label == "ratio exactly-once" and set(ratio) == {"over_spark_sink", "cpu_over_spark_sink"}
    assert all(float(v) > 0 for v in ratio.values())


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


def test_cpu_snapshot_charges_a_busy_server_process_to_the_server() -> None:
    """A child that spins for 0.8 s of CPU is the 'server': its CPU shows there, however long a
    busy machine takes to give it that much; an idle child (the broken variant: nothing to count)
    shows about none."""
    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.8: pass\nprint('done', flush=True)\ntime.sleep(30)"
    idle = "import time\ntime.sleep(0.5)\nprint('done', flush=True)\ntime.sleep(30)"
    charged = {}
    for name, code in (("spin", spin), ("idle", idle)):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            a, t0 = measure.cpu_snapshot(proc.pid, None), time.monotonic()
            assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
            b, wall = measure.cpu_snapshot(proc.pid, None), time.monotonic() - t0
            charged[name] = measure.cpu_delta(a, b, wall)["server"] * wall
        finally:
            proc.kill()
            proc.wait(timeout=10)
    assert charged["spin"] >= 0.5, charged
    assert charged["idle"] < 0.15, charged


def test_sql_counter_counts_statements_and_checkouts(engine) -> None:  # noqa: ANN001 - conftest's fixture
    from sqlalchemy import text

    from coordinator.store import driver_sql
    from coordinator.store.driver_sql import DriverStatement, run_together

    counter = measure.SqlCounter(engine)
    with engine.begin() as conn:  # BEGIN, 2 statements, COMMIT
        conn.execute(text("SELECT 1"))
        conn.execute(text("SELECT 2"))
    with engine.connect() as conn:  # BEGIN, a statement, the ROLLBACK of close
        conn.execute(text("SELECT 3"))
    assert (counter.statements, counter.checkouts, counter.round_trips()) == (3, 2, 7)
    counter.reset()
    with engine.begin() as conn:  # the BEGIN with the first statement, the COMMIT with the last
        DriverStatement("SELECT 1 AS one").rows(conn, {})
        DriverStatement("SELECT 2 AS two").rows(conn, {}, commit=True)
    with engine.begin() as conn:  # the BEGIN with the first statement, then COMMIT
        DriverStatement("SELECT 3 AS three").rows(conn, {})
    assert (counter.statements, counter.checkouts, counter.round_trips()) == (3, 2, 4)
    counter.reset()
    with engine.begin() as conn:  # BEGIN, two statements and COMMIT in one send
        run_together(conn, ((DriverStatement("SELECT 4 AS four"), {}), (DriverStatement("SELECT 5 AS five"), {})),
                     commit=True)
    assert (counter.statements, counter.checkouts, counter.round_trips()) == (2, 1, 1)
    counter.close()  # the driver's sends are no longer counted
    assert not getattr(driver_sql._execute, "counted", False)


def test_floor_measures_committed_updates(database_url: str) -> None:
    import psycopg

    figures = measure.floor(database_url, 0.3, 1)
    with psycopg.connect(measure.plain_url(database_url)) as conn:
        done = conn.execute("SELECT sum(n) FROM bench_floor").fetchone()[0]
    # the rate is what was committed: the rows' counters agree with it
    assert done > 0 and figures["update_tx_per_s"] > 0
    assert abs(int(done) - figures["update_tx_per_s"] * 0.3) <= 0.5 * int(done) + 5


def test_seeded_history_is_committed_batches_of_a_retired_sink_and_analyzed(database_url: str) -> None:
    import psycopg

    measure.seed_history(database_url, "t1", checkpoints=50, partitions=3, ids=20)
    with psycopg.connect(measure.plain_url(database_url), autocommit=True) as conn:
        sinks = conn.execute("SELECT name, retired_at IS NOT NULL FROM sinks").fetchall()
        assert sinks == [("bench-history-t1", True)]
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM checkpoints WHERE state = 'COMMITTED'), "
            "(SELECT count(*) FROM attempts WHERE state = 'COMMITTED'), "
            "(SELECT count(*) FROM leases WHERE state = 'COMMITTED' AND resolved_at IS NOT NULL), "
            "(SELECT count(*) FROM events), (SELECT count(*) FROM checkpoints WHERE state <> 'COMMITTED')").fetchone()
        assert counts == (50, 50, 150, 50, 0)
        ids = conn.execute("SELECT count(*), count(DISTINCT transactional_id) FROM transactional_ids "
                           "WHERE state = 'FREE' AND lease_id IS NULL").fetchone()
        assert ids == (20, 20)
        # one batch in ten has its first tries as lease rows, the others on their attempt rows
        assert conn.execute("SELECT count(*) FROM attempts WHERE first_tids IS NULL").fetchone() == (5,)
        # every table's statistics now describe its rows (the planner's view of a running deployment)
        stats = dict(conn.execute("SELECT relname, reltuples FROM pg_class WHERE relname IN "
                                  "('checkpoints', 'attempts', 'lease_rows', 'events', 'transactional_ids')").fetchall())
        assert stats == {"checkpoints": 50, "attempts": 50, "lease_rows": 15, "events": 50, "transactional_ids": 20}


def test_http_overhead_bench_prints_a_line_per_variant() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "http_overhead.py"), "--seconds", "0.5", "--clients", "1"],
                         cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = dict(measure.parse_figure_line(line) for line in out.stdout.splitlines() if line.startswith("http "))
    assert set(figures) == {f"http {loop} {route}" for loop in ("uvloop", "asyncio") for route in ("sync", "async")}
    for f in figures.values():
        assert float(f["cpu_us_per_call"]) > 0 and float(f["calls_per_s"]) > 0, f


def test_http_overhead_bench_splits_the_real_servers_cpu_by_thread() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "http_overhead.py"), "--coordinator", "--seconds", "1",
                          "--clients", "1"],
                         cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (label, f), = [measure.parse_figure_line(line) for line in out.stdout.splitlines() if line.startswith("http ")]
    assert label == "http coordinator", label
    # one client's calls all run on the event loop (the fast lane hands a call to its threads only
    # when half the pool's worth already run there): the loop does the work; the other threads (the
    # recovery loop) may not be scheduled at all in one second
    assert float(f["loop_cpu_us_per_call"]) > 0, f
    assert float(f["loop_cpu_us_per_call"]) > 5 * float(f["threads_cpu_us_per_call"]), f
    assert float(f["cpu_us_per_call"]) == pytest.approx(
        float(f["loop_cpu_us_per_call"]) + float(f["threads_cpu_us_per_call"]), rel=0.01, abs=2)
    assert float(f["calls_per_s"]) > 0, f


@pytest.mark.real_kafka
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_writer_task_breakdown_runs_the_two_call_protocol_on_a_real_broker() -> None:
    """A tiny run of bench/writer_task_breakdown.py (its own Kafka and coordinator): a median per
    step; every task try asks the lease route for its id, reads its producer id from librdkafka's
    log without waiting for a statistics report, and every batch commits with the tasks'
    pre-commit records (the bench exits non-zero otherwise)."""
    cmd = [sys.executable, str(BENCH / "writer_task_breakdown.py"), "--batches", "2", "--partitions", "2",
           "--records", "200"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    medians = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1].replace(".", "", 1).isdigit() and parts[-2].replace(".", "", 1).isdigit():
            medians[" ".join(parts[:-2])] = float(parts[-2])
    assert medians["lease"] > 0  # every try claims its lease at the coordinator
    assert medians["producer_id_epoch"] < 1.0  # read from the eos log: no statistics report to wait for
    assert medians["init_transactions"] > 0 and medians["task"] > 0
    assert medians["begin (per batch)"] > 0 and medians["commit (per batch)"] > 0


@pytest.mark.real_kafka
@pytest.mark.timeout(300)
def test_end_txn_bench_commits_both_ways_and_checks_what_read_committed_sees() -> None:
    cmd = [sys.executable, str(BENCH / "end_txn_bench.py"), "--sizes", "2", "4", "--rounds", "1"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # two rounds (a warm-up and one measured) of both ways, 2 + 4 transactions each
    assert "read_committed sees 24 records of 24 committed transactions (ok)" in out.stdout, out.stdout
    figures = dict(measure.parse_figure_line(line) for line in out.stdout.splitlines() if line.startswith("end_txn "))
    assert set(figures) == {"end_txn N=2", "end_txn N=4"}, out.stdout
    for f in figures.values():
        assert all(float(f[k]) > 0 for k in ("calls_cpu_ms_per_end_txn", "pass_cpu_ms_per_end_txn", "cpu_ratio")), f


def test_compare_checkouts_runs_both_sides_and_leaves_nothing_behind(database_url: str) -> None:
    """Against itself (base HEAD): each side migrated and seeded by its own code, a line per shape
    with both sides' figures, and afterwards no database and no worktree of the run."""
    cmd = [sys.executable, str(BENCH / "compare_checkouts.py"), "--base", "HEAD", "--database-url", database_url,
           "--shape", "2:2", "--shape", "3:1", "--rounds", "1", "--seconds", "0.5", "--warmup", "0.2",
           "--history", "20"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = dict(measure.parse_figure_line(line) for line in out.stdout.splitlines() if line.startswith("compare "))
    assert set(figures) == {"compare P=2", "compare P=3"}, out.stdout
    for f in figures.values():
        assert all(float(f[k]) > 0 for k in ("base_pg_ms", "head_pg_ms", "base_coord_ms", "head_coord_ms",
                                             "pg_ratio", "batches_ratio")), f
    with psycopg.connect(measure.plain_url(database_url), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname LIKE 'compare\\_%'").fetchone() == (0,)
    worktrees = subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert "compare-checkouts-" not in worktrees, worktrees
