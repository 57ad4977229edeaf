"""The real-Kafka harness itself (localkafka/): what it starts is a real broker with the settings
the other tests rely on, and it leaves nothing running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.kafka_producers import ProducerProcess, partition_log
from localkafka import LocalKafka
from fixtures.real_kafka import RealKafka

ROOT = Path(__file__).resolve().parent.parent


def test_a_read_committed_consumer_sees_committed_records_only(real_kafka: RealKafka) -> None:
    """What the stand-in could not show: an open transaction's records are invisible to a
    read_committed reader and hold the last stable offset; aborted ones never show."""
    topic = real_kafka.create_topic()
    open_txn = ProducerProcess(real_kafka.bootstrap, f"open-{topic}", topic, records=3, stay=True)
    try:
        open_txn.wait_ready()
        log = partition_log(real_kafka.bootstrap, topic, 0)
        assert log.high_watermark == 3 and log.last_stable_offset == 0
        from confluent_kafka import Producer

        committed = Producer({"bootstrap.servers": real_kafka.bootstrap, "transactional.id": f"c-{topic}"})
        committed.init_transactions(30)
        for value in (b"a", b"b"):
            committed.begin_transaction()
            committed.produce(topic, value=value, partition=0)
            assert committed.flush(30) == 0  # in the log before the transaction ends
            (committed.commit_transaction if value == b"a" else committed.abort_transaction)(30)
    finally:
        open_txn.close()  # the process exits without ending its transaction
    # the first transaction still holds the last stable offset, so nothing is readable yet
    assert partition_log(real_kafka.bootstrap, topic, 0).last_stable_offset == 0
    aborter = Producer({"bootstrap.servers": real_kafka.bootstrap, "transactional.id": f"open-{topic}"})
    aborter.init_transactions(30)  # fences the open transaction: the broker aborts it
    values = [m.value() for m in real_kafka.read_committed(topic)]
    assert values == [b"a"]
    markers = [b.marker for b in partition_log(real_kafka.bootstrap, topic, 0).batches if b.marker]
    assert sorted(markers) == ["abort", "abort", "commit"]


def test_the_command_line_starts_and_stops_a_cluster_leaving_nothing_running(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    directory = tmp_path / "cli"
    from localkafka import free_port

    port = free_port()
    started = subprocess.run([sys.executable, "-m", "localkafka", "start", "--dir", str(directory), "--port", str(port),
                              "--transaction-version", "1"], capture_output=True, text=True, env=env, timeout=180)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == f"127.0.0.1:{port}"
    cluster = LocalKafka.attach(directory)
    pids = [n.pid for n in cluster.nodes]
    status = subprocess.run([sys.executable, "-m", "localkafka", "status", "--dir", str(directory)],
                            capture_output=True, text=True, env=env)
    assert status.returncode == 0 and "running" in status.stdout
    assert "transaction.version=1" in started.stderr
    stopped = subprocess.run([sys.executable, "-m", "localkafka", "stop", "--dir", str(directory)],
                             capture_output=True, text=True, env=env, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not directory.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]


def test_a_second_start_in_a_running_directory_is_refused(real_kafka: RealKafka) -> None:
    from localkafka import LocalKafkaError

    with pytest.raises(LocalKafkaError, match="already holds a running cluster"):
        LocalKafka(real_kafka.cluster.directory).start()


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI failed once when the random cluster id began with "-": kafka-storage took it for a flag.
    Ids are drawn as Kafka draws them, and a dash-led draw is thrown away."""
    import uuid

    from localkafka import cluster

    dash_led = uuid.UUID(bytes=b"\xf8" + bytes(15))  # base64 of 0xf8… starts with "-"
    plain = uuid.UUID(bytes=b"\x10" * 16)
    draws = iter([dash_led, plain])
    monkeypatch.setattr(cluster.uuid, "uuid4", lambda: next(draws))
    assert cluster.new_cluster_id() == "EBAQEBAQEBAQEBAQEBAQEA"
    monkeypatch.undo()
    assert not any(cluster.new_cluster_id().startswith("-") for _ in range(2000))
