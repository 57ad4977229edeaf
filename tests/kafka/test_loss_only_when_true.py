"""Issue 15 items 1, 4 and 5 on a real Apache Kafka (both transaction versions): which refusals end a
commit, and the read_committed check that decides whether a refused commit lost data.

Producers are confluent-kafka transactional producers in their own processes (as executors);
the coordinator's side is the real control plane (coordinator/kafka/wire/,
coordinator/kafka/outcome.py). Each transaction writes its own partition of a fresh topic, so its
first offset there is 0. Error codes the broker cannot be made to send on demand
(UNKNOWN_SERVER_ERROR, an authorization failure) come from the fault proxy in front of the broker.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any
import uuid
from collections.abc import Iterator

import pytest
from kafka.protocol.producer import EndTxnRequest
from fixtures.kafka_producers import ProducerProcess, run_transactional_producer
from fixtures.real_kafka import RealKafka

from coordinator.kafka.control_plane import (
    ControlPlaneError,
    KafkaTarget,
    PreparedTransaction,
    TransactionOutcome,
)
from coordinator.kafka.wire.control_plane import KafkaWireControlPlane
from coordinator.protocol import errors as e

TIMEOUT_MS = 60_000
UNKNOWN_SERVER_ERROR = -1
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53


@pytest.fixture
def plane() -> Iterator[KafkaWireControlPlane]:
    p = KafkaWireControlPlane(request_timeout_ms=5_000, retry_budget_ms=15_000)
    yield p
    p.close()


def produce(kafka: RealKafka, topic: str, partition: int) -> PreparedTransaction:
    tid = f"loss-{uuid.uuid4().hex[:8]}"
    stats = run_transactional_producer(kafka.bootstrap, tid, topic, partition=partition, records=3,
                                       transaction_timeout_ms=TIMEOUT_MS)
    return PreparedTransaction(tid, stats.producer_id, stats.producer_epoch)


def test_the_log_tells_committed_from_aborted_and_says_unknown_while_open(
    kafka_each_tv: RealKafka, plane: KafkaWireControlPlane
) -> None:
    kafka = kafka_each_tv
    topic = kafka.create_topic(partitions=3)
    target = KafkaTarget("s", kafka.bootstrap, TIMEOUT_MS)
    committed, aborted, still_open = (produce(kafka, topic, p) for p in range(3))
    plane.commit(target, committed)
    plane.abort(target, aborted.transactional_id)

    assert plane.transaction_outcome(target, committed, [(topic, 0, 0)]) is TransactionOutcome.COMMITTED
    assert plane.transaction_outcome(target, aborted, [(topic, 1, 0)]) is TransactionOutcome.ABORTED
    # the open transaction holds the last stable offset at its first record: nothing is decided yet
    assert plane.transaction_outcome(target, still_open, [(topic, 2, 0)]) is TransactionOutcome.UNKNOWN
    assert plane.transaction_outcome(target, committed, []) is TransactionOutcome.UNKNOWN  # no first offsets
    assert plane.transaction_outcome(target, committed, [(topic, 0, 999)]) is TransactionOutcome.UNKNOWN
    plane.abort(target, still_open.transactional_id)
    assert plane.transaction_outcome(target, still_open, [(topic, 2, 0)]) is TransactionOutcome.ABORTED


def test_a_commit_applied_then_fenced_by_a_re_init_is_refused_as_gone_yet_the_log_shows_it_committed(
    kafka_each_tv: RealKafka, plane: KafkaWireControlPlane
) -> None:
    # issue 15 item 5: EndTxn applied, its answer lost; the id is initialised again (a zombie task,
    # or `coordinator kafka abort-transaction`); the retried commit is refused
    kafka = kafka_each_tv
    topic = kafka.create_topic(partitions=1)
    target = KafkaTarget("s", kafka.bootstrap, TIMEOUT_MS)
    txn = produce(kafka, topic, 0)
    plane.commit(target, txn)  # applied; pretend the answer never arrived
    plane.abort(target, txn.transactional_id)  # InitProducerId bumps the epoch
    with pytest.raises(ControlPlaneError) as exc:
        plane.commit(target, txn)
    assert exc.value.transaction_gone, exc.value.code
    assert plane.transaction_outcome(target, txn, [(topic, 0, 0)]) is TransactionOutcome.COMMITTED
    assert [m.value() for m in kafka.read_committed(topic)] != []


@pytest.mark.parametrize("error_code", [UNKNOWN_SERVER_ERROR, TRANSACTIONAL_ID_AUTHORIZATION_FAILED])
def test_an_unexpected_end_txn_error_is_not_final_and_the_transaction_still_commits(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane, error_code: int
) -> None:
    # issue 15 item 4: the answer is refused, but the transaction is still committable
    kafka = kafka_faults
    topic = kafka.create_topic(partitions=1)
    txn = produce(kafka, topic, 0)
    target = KafkaTarget("s", kafka.proxied_bootstrap, TIMEOUT_MS)
    kafka.proxy.inject(EndTxnRequest.API_KEY, error_code=error_code)
    with pytest.raises(ControlPlaneError) as exc:
        plane.commit(target, txn)
    assert not exc.value.transaction_gone, exc.value.code
    assert kafka.proxy.injected[EndTxnRequest.API_KEY] == 1
    plane.commit(target, txn)  # the coordinator's retry (the answer was not final)
    assert plane.transaction_outcome(target, txn, [(topic, 0, 0)]) is TransactionOutcome.COMMITTED


def test_a_transaction_aborted_at_its_timeout_is_refused_as_gone_and_the_log_confirms_the_loss(
    kafka_tv2: RealKafka, plane: KafkaWireControlPlane
) -> None:
    kafka = kafka_tv2
    topic = kafka.create_topic(partitions=1)
    tid = f"loss-{uuid.uuid4().hex[:8]}"
    proc = ProducerProcess(kafka.bootstrap, tid, topic, records=2, transaction_timeout_ms=2_000)
    try:
        stats = proc.wait_ready()
        assert proc.exited_without_commit() == 0
    finally:
        proc.close()
    txn = PreparedTransaction(tid, stats.producer_id, stats.producer_epoch)
    target = KafkaTarget("s", kafka.bootstrap, 2_000)
    deadline = time.monotonic() + 60
    outcome = TransactionOutcome.UNKNOWN
    while outcome is TransactionOutcome.UNKNOWN and time.monotonic() < deadline:  # the broker's abort comes
        time.sleep(1)  # with its transaction-abort scan (transaction.abort.timed.out.transaction.cleanup.interval.ms)
        outcome = plane.transaction_outcome(target, txn, [(topic, 0, 0)])
    assert outcome is TransactionOutcome.ABORTED
    with pytest.raises(ControlPlaneError) as exc:
        plane.commit(target, txn)
    assert exc.value.transaction_gone, exc.value.code


# --- issue 15 item 1 on the real broker: a zombie first try's late InitProducerId ----------------


@pytest.mark.parametrize("quarantine", ["kept", "broken"])
def test_a_stalled_first_try_initialising_late_fences_no_later_batch(
    kafka_each_tv: RealKafka, engine: Any, monkeypatch: pytest.MonkeyPatch, quarantine: str
) -> None:
    """A batch's first try claims its pre-lease and stalls before init_transactions; its retry gets
    an id of its own and wins, and the commit aborts the stalled try's id. The next batch writes;
    then the stalled try's InitProducerId reaches the real broker. With the quarantine the next
    batch is on another id and commits; with the quarantine broken (the freed id leased again at
    once: the pool's cursor puts it first in line) the broker fences the next batch's transaction
    and its commit is refused as gone."""
    from confluent_kafka import Producer

    from coordinator.protocol.model import PartitionResult, PrecommitRecord
    from coordinator.protocol.states import CheckpointState
    from coordinator.service import Coordinator, Limits, SinkSpec

    if quarantine == "broken":
        monkeypatch.setattr(Limits, "quarantine", property(lambda self: timedelta(0)))
    kafka = kafka_each_tv
    topic = kafka.create_topic(partitions=1)
    plane = KafkaWireControlPlane(request_timeout_ms=5_000, retry_budget_ms=15_000)
    c = Coordinator(engine, plane, limits=Limits(kafka_parallelism=1))
    prefix = f"zombie-{uuid.uuid4().hex[:6]}"
    try:
        c.register_sink(SinkSpec("z", prefix, kafka.bootstrap, [topic], transaction_timeout_ms=TIMEOUT_MS,
                                 commit_margin_ms=6_000), "test")
        gen, _ = c.start_generation("z", "q1", "r1", "test")

        def write(try_id: int, tid: str, records: int) -> PrecommitRecord:
            s = run_transactional_producer(kafka.bootstrap, tid, topic, records=records,
                                           transaction_timeout_ms=TIMEOUT_MS)
            return PrecommitRecord(try_id, s.producer_id, s.producer_epoch, records, records * 10)

        c.begin_checkpoint("z", 0, gen, "test", partitions=1)
        stalled = c.begin_partition("z", 0, 1, gen, 0, 5)  # claims the pre-lease, never initialises
        retry = c.begin_partition("z", 0, 1, gen, 0, 7)  # an id of its own
        assert retry.transactional_id != stalled.transactional_id
        c.commit("z", 0, 1, gen, [PartitionResult(0, retry.id, write(7, retry.transactional_id, 2))], "test")

        c.begin_checkpoint("z", 1, gen, "test", partitions=1)
        nxt = c.begin_partition("z", 1, 1, gen, 0, 8)
        assert (nxt.transactional_id == stalled.transactional_id) is (quarantine == "broken")
        rec = write(8, nxt.transactional_id, 3)
        zombie = Producer({"bootstrap.servers": kafka.bootstrap, "transactional.id": stalled.transactional_id,
                           "transaction.timeout.ms": TIMEOUT_MS, "log_level": 0})
        zombie.init_transactions(30)  # the stalled try's InitProducerId lands now
        if quarantine == "kept":
            done = c.commit("z", 1, 1, gen, [PartitionResult(0, nxt.id, rec)], "test")
            assert done.checkpoint.state is CheckpointState.COMMITTED
            assert len(kafka.read_committed(topic)) == 5  # both batches, once each
        else:
            with pytest.raises(e.Conflict) as refused:  # the zombie's InitProducerId fenced batch 1's producer
                c.commit("z", 1, 1, gen, [PartitionResult(0, nxt.id, rec)], "test")
            assert refused.value.reason == e.DATA_LOST and "producer_fenced" in refused.value.message
            assert len(kafka.read_committed(topic)) == 2  # batch 1 is gone: the broker aborted it
    finally:
        c.close()
        plane.close()
