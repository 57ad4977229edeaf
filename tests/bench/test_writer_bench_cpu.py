"""The writer benchmark's CPU accounting (bench/writer_cpu.py): a worker process that burns CPU and
exits between two samples still counts, through its parent's reaped-children time, as PySpark's
daemon reaps the workers it forked. The broken variant (a process's own time only, what sampling
the daemon alone gives) misses it. No Spark, no broker: well under a second or two."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import writer_cpu  # noqa: E402

# a "daemon" that forks a "worker", which burns ~0.3 s of CPU and exits; the daemon reaps it and
# stays alive (like PySpark's daemon) until told to go
DAEMON = r"""
import os, sys, time
pid = os.fork()
if pid == 0:
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print("reaped", flush=True)
sys.stdin.readline()
"""


def test_a_worker_that_exited_between_two_samples_still_counts_and_the_broken_variant_misses_it() -> None:
    before = writer_cpu.snapshot()
    before_own = writer_cpu.snapshot(own_only=True)
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout is not None and daemon.stdout.readline().strip() == "reaped"
        time.sleep(0.05)
        after = writer_cpu.snapshot()
        after_own = writer_cpu.snapshot(own_only=True)
    finally:
        assert daemon.stdin is not None
        daemon.stdin.write("\n")
        daemon.stdin.flush()
        daemon.wait(10)
    counted = writer_cpu.seconds_between(before, after)["other"]
    missed = writer_cpu.seconds_between(before_own, after_own)["other"]
    assert counted >= 0.25, counted  # the exited worker's 0.3 s, through the daemon's reaped-children time
    assert missed < 0.15, missed  # own time only: the daemon itself did almost nothing


def test_parties_are_told_apart_by_process_tree_and_command_line() -> None:
    table = {
        1: writer_cpu.Proc(1, 0, 0, 0, "init"),
        10: writer_cpu.Proc(10, 1, 5, 5, "python bench/writer_bench.py"),
        11: writer_cpu.Proc(11, 10, 7, 7, "java -cp ... org.apache.spark.deploy.SparkSubmit pyspark-shell"),
        12: writer_cpu.Proc(12, 11, 3, 1, "python -m pyspark.daemon"),
        13: writer_cpu.Proc(13, 12, 2, 2, "python -m pyspark.daemon"),  # a forked worker
        14: writer_cpu.Proc(14, 10, 9, 9, "java -cp lib/* kafka.Kafka server.properties"),
        15: writer_cpu.Proc(15, 10, 4, 4, "python -m coordinator.cli serve"),
        16: writer_cpu.Proc(16, 15, 1, 1, "postgres -D /tmp/x"),
        17: writer_cpu.Proc(17, 10, 1, 1, "sleep 1"),
    }
    parties = writer_cpu.classify(table, 10, coordinator_pid=15, postgres_pid=16)
    assert parties == {10: "driver", 11: "spark_jvm", 12: "python_workers", 13: "python_workers", 14: "broker",
                       15: "coordinator", 16: "postgres", 17: "other"}
    assert os.getpid() in writer_cpu.classify(writer_cpu.proc_table(), os.getpid(), None, None)
