"""The benchmarks still run: each command for a second or two on a tiny load (protocol_bench in
process, over HTTP against a real `coordinator serve`, the stack floor and the real Kafka control
plane; compare_checkouts against a revision; recovery_idle; prune_bench; end_txn_bench), printing
its figure lines; and the measuring code in bench/measure.py counts what it claims to. No speed is
asserted here: figures are the benchmarks' business."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from fixtures.servers import REPO_ROOT, clean_env

BENCH = REPO_ROOT / "bench"
sys.path.insert(0, str(BENCH))

import measure  # noqa: E402


def _run(args: list[str], timeout: float = 240) -> str:
    out = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _figures(stdout: str, prefix: str = "") -> dict[str, dict[str, str]]:
    return dict(measure.parse_figure_line(line) for line in stdout.splitlines()
                if "=" in line and not line.startswith("[") and line.startswith(prefix))


def test_protocol_bench_runs_in_process_over_http_and_against_the_stack_floor(database_url: str, tmp_path: Path) -> None:
    stdout = _run([str(BENCH / "protocol_bench.py"), "--database-url", database_url, "--seconds", "1",
                   "--warmup", "0.5", "--shape", "2:1", "--procs", "1", "--workers", "1", "--floor-seconds", "0.5",
                   "--floor-threads", "2", "--history", "300", "--history-ids", "50", "--json", str(tmp_path / "o.json")])
    figures = _figures(stdout)
    assert float(figures["floor"]["update_tx_per_s"]) > 0 and float(figures["floor"]["select1_per_s"]) > 0
    assert set(figures["statement_cost"]) == {"sqlalchemy_us", "driver_us", "psycopg_us"}
    for run in ("P=2 inprocess", "P=2 http", "P=2 stack-floor"):
        f = figures[run]
        assert f["errors"] == "0", f
        assert all(float(f[k]) > 0 for k in ("batches_per_s", "cpu_ms_per_batch", "p50_ms", "p99_ms",
                                             "lease_p99_ms", "commit_p99_ms")), f
        # begin, a lease call per partition (the first try claims its pre-lease), commit
        assert f["calls_per_batch"] == "4.00", f
    assert float(figures["P=2 inprocess"]["statements_per_batch"]) > 4
    ratio = figures["ratio P=2 http/stack-floor"]
    assert all(float(ratio[k]) > 0 for k in ("cpu_per_batch", "coordinator_cpu", "postgres_cpu", "batches_per_s"))
    assert stdout.count("record check: ok") == 3 and "MISMATCH" not in stdout
    assert stdout.strip().splitlines()[-1].startswith("P=2 http batches_per_s=")


def test_stack_floor_serves_the_load_and_its_record_check_sees_what_it_wrote(database_url: str, tmp_path: Path) -> None:
    """The floor's server answers the load's calls as the coordinator does (begin, a claim per
    try, commit), writes each batch COMMITTED, and refuses what is not its one happy path; its
    record check fails on a batch left undecided and on a batch it never wrote."""
    import stack_floor
    from protocol_clients import HttpSink, Record, Rejected

    url = measure.plain_url(database_url)
    stack_floor.create_schema(url)
    (sink,) = stack_floor.register(url, ["floor-a"], 3)
    server = stack_floor.FloorServer(url, 1, 2, tmp_path / "floor.log")
    try:
        client = HttpSink(server.base_url, sink["name"], sink["token"])
        assert client.claims
        generation = client.start_generation("q", "r")
        for batch in range(3):
            begun = client.begin(batch, generation, 3)
            assert (begun.attempt, begun.pre_leased) == (1, 3)
            leases = [client.lease(batch, 1, generation, p, 10 * batch + p) for p in range(3)]
            assert [tid for _, tid in leases] == [f"tx-floor-a-{p}" for p in range(3)]
            records = [Record(10 * batch + p, 1000 + p, 0, 10) for p in range(3)]
            assert client.commit(batch, 1, generation, [(p, lid) for p, (lid, _) in enumerate(leases)], records) == 3
        with pytest.raises(Rejected):  # a batch of another generation
            client.begin(3, generation + 1, 3)
        with pytest.raises(Rejected):  # a replayed batch: not new
            client.begin(0, generation, 3)
        with pytest.raises(Rejected):
            HttpSink(server.base_url, sink["name"], "not-the-token").begin(3, generation, 3)
        client.begin(3, generation, 3)
        client.lease(3, 1, generation, 0, 99)
        with pytest.raises(Rejected):  # a second try of a claimed partition: the floor has no pool
            client.lease(3, 1, generation, 0, 100)
        client.close()
    finally:
        server.stop()
    assert stack_floor.check_record(url, ["floor-a"], 3)["ok"] is False  # batch 3 is OPEN
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM stack_floor.claims WHERE batch_id = 3")
        conn.execute("DELETE FROM stack_floor.batches WHERE batch_id = 3")
    assert stack_floor.check_record(url, ["floor-a"], 3)["ok"] is True
    assert stack_floor.check_record(url, ["floor-a"], 4)["ok"] is False  # a completed batch it never wrote


def test_protocol_bench_paces_its_drivers_to_the_rate_asked(database_url: str) -> None:
    # unpaced, one in-process driver runs tens of two-partition batches a second here; paced at
    # 5/s over 2 drivers, a 2-second window holds ~10 (each driver's batch at the edges may add one)
    stdout = _run([str(BENCH / "protocol_bench.py"), "--database-url", database_url, "--mode", "inprocess",
                   "--seconds", "2", "--warmup", "0.5", "--shape", "2:2", "--procs", "1", "--rate", "5",
                   "--floor-seconds", "0", "--history", "0"])
    figures = measure.parse_figure_line(stdout.strip().splitlines()[-1])[1]
    assert figures["target_batches_per_s"] == "5.00", figures
    assert 1 <= float(figures["batches_per_s"]) * 2 <= 12, figures
    assert "paced: 5 batches/s asked" in stdout


@pytest.mark.real_kafka
@pytest.mark.timeout(400)
def test_protocol_bench_kafka_mode_commits_real_transactions_on_a_broker(database_url: str) -> None:
    """The kafka mode as a user starts it (its own broker from localkafka): every task's
    transaction is real, the coordinator commits them (the run fails unless read_committed sees
    every record, each driver's last batch committed by the coordinator alone), the broker's CPU
    is counted apart."""
    stdout = _run([str(BENCH / "protocol_bench.py"), "--database-url", database_url, "--mode", "kafka",
                   "--seconds", "2", "--warmup", "0.5", "--shape", "3:1", "--procs", "1", "--workers", "1",
                   "--floor-seconds", "0", "--history", "0"], timeout=380)
    f = _figures(stdout)["P=3 kafka"]
    assert f["errors"] == "0" and f["calls_per_batch"] == "5.00", f
    assert all(float(f[k]) > 0 for k in ("batches_per_s", "cpu_ms_per_batch", "broker_cpu_ms", "commit_p99_ms")), f
    assert "kafka check: ok" in stdout and "record check: ok" in stdout and "MISMATCH" not in stdout


def test_compare_checkouts_runs_both_sides_both_paths_and_leaves_nothing_behind(database_url: str) -> None:
    """Against a revision (HEAD, checked out into a worktree for the run): each side migrated and
    seeded by its own code, a line per (shape, path, mode) with both sides' figures and the
    budget on the same calls; afterwards no database and no worktree of the run."""
    stdout = _run([str(BENCH / "compare_checkouts.py"), "--base", "HEAD", "--database-url", database_url,
                   "--shape", "2:1", "--mode", "inprocess", "--rounds", "1", "--seconds", "0.5", "--warmup", "0.2",
                   "--history", "20", "--procs", "1"], timeout=280)
    figures = _figures(stdout, "compare ")
    assert set(figures) == {"compare P=2 same-calls inprocess", "compare P=2 classic inprocess"}, stdout
    for f in figures.values():
        assert all(float(f[k]) > 0 for k in ("base_cpu_ms", "head_cpu_ms", "cpu_ratio", "coord_ratio",
                                             "batches_ratio")), f
        assert f["base_calls"] == f["head_calls"] == "4.00", f  # the same code on both sides
    assert figures["compare P=2 same-calls inprocess"]["budget"] == "1.25"
    with psycopg.connect(measure.plain_url(database_url), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pg_database WHERE datname LIKE 'compare\\_%'").fetchone() == (0,)
    worktrees = subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert "compare-checkouts-" not in worktrees, worktrees


def test_recovery_idle_prints_a_line_per_number_of_idle_sinks(database_url: str) -> None:
    # --code names the checkout whose coordinator runs (here this one, through the re-exec that
    # puts it first on the path)
    stdout = _run([str(BENCH / "recovery_idle.py"), "--database-url", database_url, "--sinks", "2", "5",
                   "--seconds", "1", "--settle", "0.2", "--workers", "1", "--code", str(REPO_ROOT)])
    assert f"recovery_idle: {REPO_ROOT}," in stdout
    lines = [measure.parse_figure_line(x)[1] for x in stdout.splitlines() if x.startswith("idle sinks=")]
    assert [x["sinks"] for x in lines[-2:]] == ["2", "5"], stdout
    for f in lines[-2:]:
        assert float(f["server_cpu_ms_per_s"]) >= 0 and float(f["seconds"]) >= 1, f
    with psycopg.connect(measure.plain_url(database_url), autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM checkpoints WHERE state = 'COMMITTED'").fetchone() == (5,)


def test_prune_bench_prunes_all_but_the_newest_and_measures_the_space() -> None:
    """bench/prune_bench.py on its own Postgres: the batches are pruned (all but the newest), a
    pruned batch keeps less than a whole one, and the figures are there."""
    stdout = _run([str(BENCH / "prune_bench.py"), "--partitions", "20", "--batches", "40", "--chunk", "15"])
    (label, f), = [measure.parse_figure_line(line) for line in stdout.splitlines() if line.startswith("prune P=")]
    assert label == "prune P=20" and f["batches"] == "39"
    assert 0 < int(f["kept_bytes_per_batch"]) < int(f["bytes_per_batch"])
    assert float(f["postgres_cpu_ms_per_batch"]) >= 0 and float(f["chunk_p50_ms"]) > 0
    assert "chunks: 3 of <= 15 batches" in stdout


@pytest.mark.real_kafka
@pytest.mark.timeout(300)
def test_end_txn_bench_commits_both_ways_and_checks_what_read_committed_sees() -> None:
    stdout = _run([str(BENCH / "end_txn_bench.py"), "--sizes", "2", "4", "--rounds", "1"], timeout=280)
    # two rounds (a warm-up and one measured) of both ways, 2 + 4 transactions each
    assert "read_committed sees 24 records of 24 committed transactions (ok)" in stdout, stdout
    figures = _figures(stdout, "end_txn ")
    assert set(figures) == {"end_txn N=2", "end_txn N=4"}, stdout
    for f in figures.values():
        assert all(float(f[k]) > 0 for k in ("calls_cpu_ms_per_end_txn", "pass_cpu_ms_per_end_txn", "cpu_ratio")), f


def test_statements_per_call_counts_each_call_and_the_batch(database_url: str) -> None:
    stdout = _run([str(BENCH / "statements_per_call.py"), "--database-url", database_url, "--partitions", "3"])
    lines = [measure.parse_figure_line(x) for x in stdout.splitlines() if x.startswith("statements P=3")]
    by_call = {f["call"]: f for _, f in lines}
    assert set(by_call) == {"begin", "lease", "commit", "batch"}, stdout
    for key in ("statements", "transactions", "clock_reads"):
        assert int(by_call["batch"][key]) == sum(int(by_call[c][key]) for c in ("begin", "lease", "commit"))
    # three lease calls, each its own transaction; every call sends at least one statement
    assert int(by_call["lease"]["transactions"]) == 3
    assert all(int(by_call[c]["statements"]) >= 1 for c in ("begin", "lease", "commit"))
