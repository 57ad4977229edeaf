"""The executors' side of the benchmark's `kafka` mode: a real Kafka transaction on every lease a
batch's tasks write with, opened the cheapest real way found, so the coordinator's commit (its
EndTxn calls on the broker) is the real one a deployment pays.

The writer's executors make a new confluent-kafka producer per task and call init_transactions
(FindCoordinator + InitProducerId), which for hundreds of tasks a second would starve the server
the benchmark measures on the cores they share. Here each transactional id keeps one long-lived
producer:

- the first time an id is used, a probe producer with statistics on runs init_transactions and
  reads the producer id and epoch from librdkafka's statistics (the only place it exposes them,
  as the writer's executor reads them); then the id's long-lived producer (statistics off: a
  report per producer every interval would cost the load side more than the coordinator's work)
  runs init_transactions, which bumps the epoch by one on the same producer id (KIP-98);
- per task: begin_transaction, produce, flush: (producer id, epoch, the first offset written) go
  into the task's record, as the writer's executor reports them. The transaction stays open;
- after the coordinator answered COMMITTED (its own EndTxn, at transaction version 1 semantics),
  `finished` calls the producer's commit_transaction: Kafka answers a repeated EndTxn(commit) of a
  completed commit with NONE, without writing markers again, and the producer is ready for the
  next transaction without another InitProducerId.

So a batch's broker work is that of a deployment whose executors reuse their producers, plus one
no-op EndTxn per transaction; its coordinator work is exactly a deployment's. A wrong epoch
cannot pass unseen: the coordinator's EndTxn would be refused (PRODUCER_FENCED), the batch LOST
and the run failed. `close(commit=False)` leaves the last transactions to the coordinator alone:
the run's check reads the topic with read_committed, where an uncommitted one would hold the last
stable offset."""

from __future__ import annotations

import json
import threading
import time
from typing import Any


class TransactionPool:
    """Long-lived transactional producers by transactional id, for one load process's tasks."""

    def __init__(self, bootstrap: str, topic: str, topic_partitions: int, records_per_task: int = 1) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.topic_partitions = topic_partitions
        self.records_per_task = records_per_task
        self._producers: dict[str, tuple[Any, int, int]] = {}  # tid -> (producer, id, epoch)
        self._lock = threading.Lock()
        self.opened = 0  # transactions opened (each holds records_per_task records)

    def _config(self, tid: str) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap, "transactional.id": tid, "linger.ms": 0, "log_level": 0,
                "transaction.timeout.ms": 60_000}

    def _initialised(self, tid: str) -> tuple[Any, int, int]:
        from confluent_kafka import Producer

        seen: dict[str, Any] = {}
        probe = Producer({**self._config(tid), "statistics.interval.ms": 50,
                          "stats_cb": lambda raw: seen.update(json.loads(raw).get("eos") or {})})
        probe.init_transactions(60)
        deadline = time.monotonic() + 30
        while seen.get("idemp_state") != "Assigned" or seen.get("producer_id", -1) < 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no producer id for {tid} in librdkafka's statistics after 30 s")
            probe.poll(0.02)
        producer_id, epoch = int(seen["producer_id"]), int(seen["producer_epoch"])
        probe.flush(10)
        del probe
        producer = Producer(self._config(tid))
        producer.init_transactions(60)  # the same producer id, the epoch one up
        return producer, producer_id, epoch + 1

    def open(self, tid: str, partition: int) -> tuple[int, int, list[list[Any]]]:
        """A transaction on `tid` holding this task's records, flushed and left open: (producer
        id, epoch, [[topic, partition, first offset]])."""
        with self._lock:
            entry = self._producers.pop(tid, None)  # one task at a time per id
        if entry is None:
            entry = self._initialised(tid)
        producer, producer_id, epoch = entry
        offsets: list[int] = []
        target = partition % self.topic_partitions

        def delivered(err: Any, msg: Any) -> None:
            if err is None:
                offsets.append(msg.offset())

        producer.begin_transaction()
        for i in range(self.records_per_task):
            producer.produce(self.topic, value=b"x" * 100, key=tid.encode(), partition=target, on_delivery=delivered)
        if producer.flush(60) != 0 or len(offsets) != self.records_per_task:
            raise RuntimeError(f"{tid}: {self.records_per_task - len(offsets)} records not delivered")
        with self._lock:
            self._producers[tid] = entry
            self.opened += 1
        return producer_id, epoch, [[self.topic, target, min(offsets)]]

    def finished(self, tids: list[str]) -> None:
        """After the coordinator committed: each producer's own EndTxn(commit), a no-op at the
        broker, readies it for its next transaction."""
        for tid in tids:
            with self._lock:
                entry = self._producers.get(tid)
            if entry is not None:
                entry[0].commit_transaction(60)

    def close(self) -> None:
        """Drop every producer; their last transactions stay as the coordinator left them."""
        with self._lock:
            self._producers.clear()


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(60)


def count_committed(bootstrap: str, topic: str, timeout_s: float = 90.0) -> int:
    """Records a read_committed consumer sees in `topic`, up to each partition's last stable
    offset; raises if a partition does not reach it (an open transaction holds it)."""
    import uuid

    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True, "log_level": 0})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        pending, seen = set(partitions), 0
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic}: partitions {sorted(pending)} did not reach their last stable offset "
                                   f"within {timeout_s:.0f} s: a transaction is still open")
            for msg in consumer.consume(10_000, 0.5):
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                        continue
                    raise RuntimeError(f"{topic}: {msg.error()}")
                seen += 1
        return seen
    finally:
        consumer.close()
