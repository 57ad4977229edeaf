"""Helpers for the Spark writer tests: a real coordinator (uvicorn) with the Kafka control plane on a
database of its own, a local PySpark session, fault hooks for tasks and drivers, and the
exactly-once check against the coordinator's records and the topic's provenance headers.

The broker is a real Apache Kafka (tests/real_kafka.py). The check counts what a `read_committed`
consumer sees: every input value exactly once. It cross-checks that each visible record's
provenance headers name a committed winner in the coordinator's records, and that each winner's
transaction ended with a COMMIT marker in the broker's log; `Outcome.records` (read_uncommitted)
also holds the aborted copies, for tests that show they exist.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import migrated_database
from kafka_producers import partition_log
from servers import ServiceProcess
from sparkclient.client import CoordinatorClient

ADMIN = "spark-writer-admin"
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def module_database_url(postgres_server_url: str, template_url: str) -> Iterator[str]:
    """A fresh migrated database shared by one test module (one coordinator process per module)."""
    with migrated_database(postgres_server_url, "s") as url:
        yield url


def kafka_service(database_url: str, log_dir: Path, **env: str) -> ServiceProcess:
    """The coordinator as deployed, committing for real: EndTxn by resume on the broker."""
    return ServiceProcess(database_url, ADMIN, log_dir, name="coordinator-kafka", env={
        "COORDINATOR_KAFKA_CONTROL_PLANE": "kafka",
        "COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS": "2000",
        "COORDINATOR_KAFKA_RETRY_BUDGET_MS": "5000",
        "COORDINATOR_RECOVERY_INTERVAL_MS": "1000",
        **env,
    })


def register(service: ServiceProcess, sink: str, bootstrap: str, topic: str, **extra: Any) -> str:
    """Register a sink; returns its writer token."""
    with CoordinatorClient(service.url, ADMIN, sink) as admin:
        return admin.register_sink(f"{sink}-tx", bootstrap, [topic], **extra)["writer_token"]


def spark_session(app: str, master: str | None = "local[2,4]", *, remote: str | None = None, **conf: str) -> Any:
    """A local session whose Python workers run this interpreter and can import the test helpers
    (fault hooks are pickled by reference). local[N,F]: N threads, F tries per task. With `remote`
    (e.g. "local[2,4]"), a Spark Connect session on pyspark's local Connect server instead.

    Every session carries Spark's Kafka connector (spark.jars): only the JVM's launch (the first
    session of the pytest process) puts jars on the driver's class path, and a later module's
    session runs in that same JVM."""
    from pyspark.sql import SparkSession

    from localkafka.maven import spark_kafka_jars

    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [str(TESTS_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if remote is not None:
        builder = SparkSession.builder.remote(remote).appName(app)
    else:
        builder = (SparkSession.builder.master(master).appName(app).config("spark.ui.enabled", "false")
                   .config("spark.speculation", "true"))
    builder = builder.config("spark.sql.shuffle.partitions", "4").config("spark.jars", ",".join(spark_kafka_jars()))
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    if remote is None:
        spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_input_files(directory: Path, batches: list[list[int]]) -> None:
    """One JSON-lines file per batch (the file source with maxFilesPerTrigger=1 makes each one
    micro-batch); an empty list makes an empty file, hence an empty batch."""
    directory.mkdir(parents=True, exist_ok=True)
    start = time.time() - 3600
    for i, values in enumerate(batches):
        path = directory / f"part-{i:04d}.json"
        path.write_text("".join(f'{{"n": {v}}}\n' for v in values))
        os.utime(path, (start + i, start + i))  # the file source takes files in modification-time order


# --- fault hooks (pickled to executors by reference: this module is on the workers' path) ---------


@dataclass(frozen=True)
class FailTask:
    """Raise in the first attempt of the named tasks at a step: the task fails and Spark retries it.
    `at`: {(step, batch_id, partition)}."""

    at: frozenset[tuple[str, int, int]]

    def __call__(self, step: str, **info: Any) -> None:
        key = (step, info.get("batch_id"), info.get("partition"))
        if info.get("task_attempt") == 0 and key in self.at:
            raise RuntimeError(f"injected task failure at {step} (batch {key[1]}, partition {key[2]})")


@dataclass(frozen=True)
class KillGroup:
    """SIGKILL the crash-test driver's process group (Python driver and JVM) and the calling
    process at a step of a batch. Python workers run in a process group of their own: other
    running tasks may go on briefly, as executors outliving their driver do, until their JVM's
    end stops them (the restarted driver's generation fences whatever they still send)."""

    step: str
    batch_id: int | None = None

    def __call__(self, step: str, **info: Any) -> None:
        if step == self.step and (self.batch_id is None or info.get("batch_id") == self.batch_id):
            group = os.environ.get("SPARK_CRASH_TEST_GROUP")
            if group is None:
                raise AssertionError("KillGroup only runs under a crash-test driver (tests/spark_crash_driver.py)")
            sys.stdout.write(f"[driver] killing process group at {step} (batch {info.get('batch_id')})\n")
            sys.stdout.flush()
            os.killpg(int(group), signal.SIGKILL)  # the driver and its JVM
            os.kill(os.getpid(), signal.SIGKILL)  # a Python worker runs in a group of its own


# --- reading the outcome --------------------------------------------------------------------------


@dataclass(frozen=True)
class TopicRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]


def read_topic(bootstrap: str, topic: str, timeout_s: float = 30.0, *, committed: bool = False) -> list[TopicRecord]:
    """Every record of the topic: read_uncommitted (aborted and open transactions' records too), or
    what a read_committed consumer sees."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "log_level": 3,
                         "isolation.level": "read_committed" if committed else "read_uncommitted"})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        records: list[TopicRecord] = []
        deadline = time.monotonic() + timeout_s
        idle_since = time.monotonic()
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                if time.monotonic() - idle_since > 2.0:  # everything written is long in the broker
                    break
                continue
            idle_since = time.monotonic()
            if msg.error():
                continue
            headers = {k: v.decode() for k, v in (msg.headers() or []) if v is not None}
            records.append(TopicRecord(msg.partition(), msg.offset(), msg.key(), msg.value(), headers))
        return records
    finally:
        consumer.close()


@dataclass(frozen=True)
class Outcome:
    checkpoints: list[dict[str, Any]]
    details: dict[int, dict[str, Any]]  # batch id -> checkpoint detail
    records: list[TopicRecord]  # everything in the log (read_uncommitted)
    committed: list[TopicRecord]  # what a read_committed consumer sees
    winners: dict[int, dict[str, Any]]  # lease id -> lease (committed winners)
    losers: dict[int, dict[str, Any]]  # lease id -> lease (every other lease)


def outcome(service: ServiceProcess, sink: str, bootstrap: str, topic: str) -> Outcome:
    with CoordinatorClient(service.url, ADMIN, sink) as c:
        checkpoints = c.checkpoints()
        details = {cp["batch_id"]: c.checkpoint(cp["batch_id"]) for cp in checkpoints}
    winners, losers = {}, {}
    for d in details.values():
        for lease in d["leases"]:
            (winners if lease["state"] == "COMMITTED" else losers)[lease["lease_id"]] = lease
    records = read_topic(bootstrap, topic)
    committed = read_topic(bootstrap, topic, committed=True)
    return Outcome(checkpoints, details, records, committed, winners, losers)


def assert_exactly_once(out: Outcome, expected_values: list[str], sink: str, bootstrap: str, topic: str) -> None:
    """Every input value visible to a read_committed consumer exactly once; no batch committed
    twice; every visible record's provenance headers name a committed winner; every winner's
    transaction ended with a COMMIT marker on the broker."""
    batches = [cp["batch_id"] for cp in out.checkpoints]
    assert len(batches) == len(set(batches)), f"a batch has two checkpoints: {batches}"
    for b, d in out.details.items():
        assert d["checkpoint"]["state"] == "COMMITTED", d
        committed_attempts = [a for a in d["attempts"] if a["state"] == "COMMITTED"]
        assert [a["number"] for a in committed_attempts] == [d["checkpoint"]["committed_attempt"]], d
        winners = [x for x in d["leases"] if x["state"] == "COMMITTED"]
        assert len({x["partition"] for x in winners}) == len(winners), f"batch {b}: two winners of one partition"
        assert all(x["attempt"] == d["checkpoint"]["committed_attempt"] for x in winners), d
    values = Counter(r.value.decode() for r in out.committed if r.value is not None)
    duplicated = {v: n for v, n in values.items() if n > 1}
    missing = sorted(set(expected_values) - set(values), key=lambda v: int(v) if v.isdigit() else v)
    unexpected = set(values) - set(expected_values)
    assert not duplicated and not missing and not unexpected, (
        f"duplicated {dict(list(duplicated.items())[:10])}, missing {missing[:20]} (of {len(missing)}), "
        f"unexpected {sorted(unexpected)[:10]}")
    for r in out.committed:
        assert int(r.headers["eos-lease-id"]) in out.winners, f"a visible record of a lease that did not win: {r}"
        lease = out.winners[int(r.headers["eos-lease-id"])]
        batch = int(r.headers["eos-batch-id"])
        assert r.headers["eos-sink"] == sink
        assert lease["lease_id"] in {x["lease_id"] for x in out.details[batch]["leases"]}, (r, lease)
        assert int(r.headers["eos-attempt"]) == lease["attempt"] == out.details[batch]["checkpoint"]["committed_attempt"]
    # the broker's own record: a COMMIT marker from each winner's (producer id, epoch)
    partitions = sorted({r.partition for r in out.records})
    markers = set()
    for p in partitions:
        for b in partition_log(bootstrap, topic, p).batches:
            if b.marker == "commit":
                markers.add((b.producer_id, b.producer_epoch))
    for lease in out.winners.values():
        assert (lease["producer_id"], lease["producer_epoch"]) in markers, f"no COMMIT marker for {lease}"


@dataclass(frozen=True)
class KillWhenDecided:
    """At `before_commit` of a batch (any batch if None), start a watcher that SIGKILLs the
    process group as soon as the coordinator shows the commit decided (checkpoint COMMITTING),
    while the driver's commit call is still waiting for Kafka (the test holds EndTxn)."""

    coordinator_url: str
    token: str
    sink: str
    batch_id: int | None = None

    def __call__(self, step: str, **info: Any) -> None:
        if step != "before_commit" or (self.batch_id is not None and info.get("batch_id") != self.batch_id):
            return
        import threading

        batch = info["batch_id"]

        def watch() -> None:
            with CoordinatorClient(self.coordinator_url, self.token, self.sink) as c:
                while c.checkpoint(batch)["checkpoint"]["state"] != "COMMITTING":
                    time.sleep(0.02)
            KillGroup("decided")("decided", batch_id=batch)

        threading.Thread(target=watch, daemon=True).start()
