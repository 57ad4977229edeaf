"""The example job's start-up when Kafka is not there: it waits a bounded time, says so, then
exits with status 2 and a message that says what to do, before Spark or the coordinator is
touched. (With Kafka there, the job itself runs in test_quickstart.py and test_spark_chain.py.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_job_waits_for_an_absent_kafka_then_exits_2_saying_what_to_do(tmp_path) -> None:
    bootstrap = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "sparkclient.example_job", "--kafka-bootstrap-servers", bootstrap,
         "--coordinator-url", "http://127.0.0.1:9", "--coordinator-admin-token", "t", "--kafka-wait-s", "3",
         "--checkpoint-location", str(tmp_path / "chk")],
        capture_output=True, text=True, timeout=120,
    )
    took = time.monotonic() - started
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"waiting for Kafka at {bootstrap}" in run.stdout
    assert f"Kafka at {bootstrap} did not answer within 3 s" in run.stderr
    assert "python -m localkafka start" in run.stderr
    assert "Traceback" not in run.stderr
    assert 3 <= took < 60  # it waited, and no longer than it was told to (plus interpreter start)
    assert not (tmp_path / "chk").exists()  # nothing of the query was made


def test_a_wait_that_is_not_a_number_is_a_usage_error() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "sparkclient.example_job", "--kafka-bootstrap-servers", "x:1",
         "--coordinator-url", "http://127.0.0.1:9", "--coordinator-admin-token", "t", "--kafka-wait-s", "soon"],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2 and "KAFKA_WAIT_S must be a whole number, got 'soon'" in run.stderr
