"""Transactional producers in other processes, and a raw read of a partition's log, for the
tests on the real broker (tests/real_kafka.py).

`ProducerProcess` runs a confluent-kafka transactional producer in its own process (the way a
Spark executor task would): init_transactions, begin_transaction, produce, flush (every delivery
report checked), then reports the producer id and epoch from librdkafka's statistics JSON
(`eos.producer_id`, `eos.producer_epoch`) and either exits at once WITHOUT committing (a
pre-committed task) or stays alive for further commands (to observe that it was fenced).

`partition_log` reads a partition with a raw Fetch (read_uncommitted) so that the transaction
markers (control batches) are visible: a COMMIT marker is the broker's record that EndTxn(commit)
took effect, an ABORT marker that the transaction was aborted. Visibility itself is judged by a
read_committed consumer (`real_kafka.read_committed`); the markers say which transaction ended how.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Batch:
    base_offset: int
    producer_id: int
    producer_epoch: int
    transactional: bool
    marker: str | None  # "commit" / "abort" for a control batch (transaction marker), else None
    records: int


@dataclass(frozen=True)
class PartitionLog:
    high_watermark: int
    last_stable_offset: int
    batches: list[Batch]

    def markers(self, producer_id: int) -> list[str]:
        """The transaction markers the broker wrote for this producer id, in log order."""
        return [b.marker for b in self.batches if b.producer_id == producer_id and b.marker is not None]

    def data_batches(self, producer_id: int) -> int:
        return sum(1 for b in self.batches if b.producer_id == producer_id and b.marker is None)

    @property
    def has_open_transaction(self) -> bool:
        return self.last_stable_offset < self.high_watermark


def partition_log(bootstrap: str, topic: str, partition: int) -> PartitionLog:
    """Everything in one partition, read with a raw Fetch (read_uncommitted, kafka-python's protocol
    and record classes) so that control batches are visible: the COMMIT or ABORT marker the broker
    wrote when a transaction ended is the broker's own record of how it ended."""
    from kafka.net.manager import KafkaConnectionManager
    from kafka.net.selector import NetworkSelector
    from kafka.protocol.consumer import FetchRequest
    from kafka.record import MemoryRecords

    config = {"bootstrap_servers": bootstrap, "client_id": "partition-log"}
    net = NetworkSelector(**config)
    manager = KafkaConnectionManager(net, **config)
    net.start()
    try:
        manager.bootstrap(10_000)
        topic_request = FetchRequest.FetchTopic
        request = FetchRequest(
            replica_id=-1, max_wait_ms=100, min_bytes=1, max_bytes=8 << 20, isolation_level=0,
            session_id=0, session_epoch=-1, max_version=12, min_version=4,  # by topic name
            topics=[topic_request(topic=topic, partitions=[
                topic_request.FetchPartition(partition=partition, fetch_offset=0, partition_max_bytes=8 << 20)
            ])],
        )

        async def fetch() -> Any:
            return await manager.send(request)

        response = manager.run(fetch)
    finally:
        manager.close()
        net.stop(timeout_ms=5_000)
    data = response.responses[0].partitions[0]
    assert data.error_code == 0, data
    batches = []
    records = MemoryRecords(bytes(data.records or b""))
    while (batch := records.next_batch()) is not None:
        items = list(batch)
        marker = None
        if batch.is_control_batch:
            marker = "commit" if items[0].commit else "abort"
        batches.append(Batch(batch.base_offset, batch.producer_id, batch.producer_epoch, batch.is_transactional,
                             marker, len(items)))
    return PartitionLog(data.high_watermark, data.last_stable_offset, batches)



# --- transactional producers in other processes ------------------------------------------------

# Runs in the child process: only confluent_kafka and the standard library are imported there.
_PRODUCER_SCRIPT = r"""
import json, os, sys, time
from confluent_kafka import KafkaException, Producer

args = json.loads(sys.argv[1])
stats = {}
fatal = []

def on_stats(raw):
    stats["eos"] = json.loads(raw).get("eos") or {}

def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()

producer = Producer({
    "bootstrap.servers": args["bootstrap"],
    "transactional.id": args["transactional_id"],
    "transaction.timeout.ms": args["transaction_timeout_ms"],
    "statistics.interval.ms": 20,
    "stats_cb": on_stats,
    "error_cb": lambda err: fatal.append(err.name()),  # reported, not raised from inside a callback
    "log_level": 3,
})
errors = []
try:
    producer.init_transactions(15)
    producer.begin_transaction()
    for i in range(args["records"]):
        producer.produce(args["topic"], value=b"record-%d" % i, partition=args["partition"],
                         on_delivery=lambda err, msg: errors.append(None if err is None else err.name()))
    left = producer.flush(15)
except KafkaException as exc:
    say(error=exc.args[0].name(), detail=str(exc.args[0]))
    os._exit(1)
failed = [e for e in errors if e is not None]
if left or failed or len(errors) != args["records"]:
    say(error="delivery_failed", left=left, delivery=errors)  # never pre-commit a lossy transaction
    os._exit(1)
# librdkafka exposes producer id and epoch only in its statistics: wait for a fresh report
stats.clear()
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    producer.poll(0.02)
    eos = stats.get("eos")
    if eos and eos.get("producer_id", -1) >= 0:
        break
else:
    say(error="no_statistics", eos=stats.get("eos"))
    os._exit(1)
say(producer_id=eos["producer_id"], producer_epoch=eos["producer_epoch"], txn_state=eos.get("txn_state"),
    records=args["records"])
if not args["stay"]:
    os._exit(0)  # no commit, no abort, no producer teardown: the transaction stays open on the broker
for line in sys.stdin:
    command = line.strip()
    if command == "produce":
        late = []
        left = 1
        try:
            producer.produce(args["topic"], value=b"late", partition=args["partition"],
                             on_delivery=lambda err, msg: late.append(None if err is None else err.name()))
            left = producer.flush(15)
        except Exception as exc:  # a fenced producer's fatal error surfaces from flush (chained)
            while exc is not None and not isinstance(exc, KafkaException):
                exc = exc.__cause__
            late.append(exc.args[0].name() if exc is not None else "unknown")
        say(left=left, delivery=late, fatal=fatal)
    elif command == "exit":
        break
os._exit(0)
"""


@dataclass(frozen=True)
class ProducerStats:
    transactional_id: str
    producer_id: int
    producer_epoch: int
    records: int


class ProducerProcess:
    """A confluent-kafka transactional producer in a separate process. `start()` returns once it
    has flushed its records (all acknowledged) and reported producer id and epoch."""

    def __init__(self, bootstrap: str, transactional_id: str, topic: str, *, partition: int = 0, records: int = 3,
                 transaction_timeout_ms: int = 60_000, stay: bool = False) -> None:
        self.transactional_id = transactional_id
        args = {
            "bootstrap": bootstrap, "transactional_id": transactional_id, "topic": topic, "partition": partition,
            "records": records, "transaction_timeout_ms": transaction_timeout_ms, "stay": stay,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PRODUCER_SCRIPT, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.stats: ProducerStats | None = None

    def _answer(self, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            self.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"producer {self.transactional_id} gave no answer; stderr:\n{err[-3000:]}")
        return json.loads(result[0])

    def wait_ready(self) -> ProducerStats:
        answer = self._answer()
        if "error" in answer:
            self.kill()
            raise AssertionError(f"producer {self.transactional_id} failed: {answer}")
        self.stats = ProducerStats(self.transactional_id, answer["producer_id"], answer["producer_epoch"],
                                   answer["records"])
        return self.stats

    def produce_more(self) -> list[str | None]:
        """Produce one more record in the same (old) transaction; returns the delivery results,
        error names or None for success."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("produce\n")
        self.proc.stdin.flush()
        return list(self._answer()["delivery"])

    def exited_without_commit(self, timeout_s: float = 15.0) -> int:
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def run_transactional_producers(
    bootstrap: str, specs: list[tuple[str, str, int]], *, records: int = 3, transaction_timeout_ms: int = 60_000
) -> list[ProducerStats]:
    """Run one producer process per (transactional id, topic, partition), all at once; each
    flushes, reports, and exits without committing. Returns their stats in order."""
    procs = [ProducerProcess(bootstrap, tid, topic, partition=partition, records=records,
                             transaction_timeout_ms=transaction_timeout_ms) for tid, topic, partition in specs]
    try:
        stats = [p.wait_ready() for p in procs]
        for p in procs:
            assert p.exited_without_commit() == 0
        return stats
    finally:
        for p in procs:
            p.close()


def run_transactional_producer(bootstrap: str, transactional_id: str, topic: str, *, partition: int = 0,
                               records: int = 3, transaction_timeout_ms: int = 60_000) -> ProducerStats:
    return run_transactional_producers(bootstrap, [(transactional_id, topic, partition)], records=records,
                                       transaction_timeout_ms=transaction_timeout_ms)[0]
