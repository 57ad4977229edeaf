"""The writer's benchmarks (bench/writer_bench.py, bench/writer_task_breakdown.py) still run, each a
tiny load on a real broker and PySpark, printing their figure lines. No speed is asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fixtures.servers import REPO_ROOT, clean_env

BENCH = REPO_ROOT / "bench"
sys.path.insert(0, str(BENCH))

import measure  # noqa: E402


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
