"""The simulation's Kafka model (sim/kafka_model.py): its own rules, and the model against a real
Kafka broker of each transaction version (the simulation's findings mean something only if the
model is faithful)."""

from __future__ import annotations

import time
import uuid

import pytest
from fixtures.kafka_producers import (
    ProducerProcess,
    fenced,
    partition_log,
    run_transactional_producer,
    settled_partition_log,
)
from fixtures.real_kafka import RealKafka

from coordinator.kafka.control_plane import ControlPlaneError, KafkaTarget, PreparedTransaction
from coordinator.kafka.wire.control_plane import KafkaWireControlPlane
from coordinator.service.clock import ManualClock
from sim.kafka_model import COMPLETE_ABORT, COMPLETE_COMMIT, ONGOING, KafkaError, KafkaModel, ModelControlPlane


# --- (b) the Kafka model ----------------------------------------------------------------------------


def model() -> tuple[KafkaModel, ManualClock]:
    clock = ManualClock()
    return KafkaModel(clock), clock


def test_init_producer_id_fences_and_aborts_the_open_transaction() -> None:
    m, _ = model()
    pid, epoch = m.init_producer_id("t", 10_000)
    assert epoch == 0
    m.produce("t", pid, epoch, "out", 0, "a")
    assert [t.transactional_id for t in m.list_open()] == ["t"]
    pid2, epoch2 = m.init_producer_id("t", 10_000)
    assert pid2 == pid and epoch2 == epoch + 2  # fence-abort bump, then the retried init's bump
    assert m.txns["t"].state == COMPLETE_ABORT and m.list_open() == []
    assert [x.marker for x in m.logs[("out", 0)]] == [None, "ABORT"]
    with pytest.raises(KafkaError) as exc:
        m.produce("t", pid, epoch, "out", 0, "late")  # the fenced producer
    assert exc.value.code == "producer_fenced"
    with pytest.raises(KafkaError) as exc:
        m.end_txn("t", pid, epoch, True)
    assert exc.value.code == "producer_fenced"
    _, epoch3 = m.init_producer_id("t", 10_000)  # nothing open: one bump
    assert epoch3 == epoch2 + 1
    assert m.read_committed("out") == []


def test_end_txn_rules_including_the_retry_of_a_completed_commit() -> None:
    m, _ = model()
    pid, epoch = m.init_producer_id("t", 10_000)
    with pytest.raises(KafkaError) as exc:
        m.end_txn("t", pid, epoch, True)  # nothing open
    assert exc.value.code == "invalid_txn_state"
    m.produce("t", pid, epoch, "out", 1, "a")
    with pytest.raises(KafkaError) as exc:
        m.end_txn("t", pid + 1, epoch, True)
    assert exc.value.code == "invalid_producer_id_mapping"
    with pytest.raises(KafkaError) as exc:
        m.end_txn("unknown", pid, epoch, True)
    assert exc.value.code == "invalid_producer_id_mapping"
    m.end_txn("t", pid, epoch, True)
    m.end_txn("t", pid, epoch, True)  # retried: success, nothing written twice
    assert m.txns["t"].state == COMPLETE_COMMIT
    assert [x.marker for x in m.logs[("out", 1)]] == [None, "COMMIT"]
    with pytest.raises(KafkaError) as exc:
        m.end_txn("t", pid, epoch, False)  # abort after commit
    assert exc.value.code == "invalid_txn_state"
    assert m.read_committed("out") == ["a"]
    plane = ModelControlPlane(m)
    tg = KafkaTarget("s", "model", 10_000)
    plane.commit(tg, PreparedTransaction("t", pid, epoch))  # the control plane's resume: same rule
    with pytest.raises(ControlPlaneError) as cpe:
        plane.commit(tg, PreparedTransaction("t", pid, epoch - 1 if epoch else epoch + 1))
    assert cpe.value.code == "producer_fenced" and cpe.value.retriable is False


def test_timeout_aborts_and_bumps_the_epoch_so_a_late_commit_is_fenced() -> None:
    m, clock = model()
    pid, epoch = m.init_producer_id("t", 10_000)
    clock.advance(ms=3_000)
    m.produce("t", pid, epoch, "out", 0, "a")  # the transaction starts at its first record
    clock.advance(ms=9_999)
    assert m.expire() == [] and m.txns["t"].state == ONGOING
    clock.advance(ms=1)
    assert m.expire() == ["t"]
    assert m.txns["t"].epoch == epoch + 1 and m.txns["t"].state == COMPLETE_ABORT
    with pytest.raises(KafkaError) as exc:
        m.end_txn("t", pid, epoch, True)
    assert exc.value.code == "producer_fenced"
    assert m.read_committed("out") == [] and m.list_open() == []


def test_the_model_answers_the_log_check_at_first_offsets() -> None:
    m, _ = model()
    plane, tg = ModelControlPlane(m), KafkaTarget("s", "model", 10_000)
    txns = {}
    for tid, partition in (("c", 0), ("a", 1), ("o", 2)):
        pid, epoch = m.init_producer_id(tid, 10_000)
        m.produce(tid, pid, epoch, "out", partition, f"{tid}1")
        m.produce(tid, pid, epoch, "out", partition, f"{tid}2")
        txns[tid] = PreparedTransaction(tid, pid, epoch)
    m.end_txn("c", txns["c"].producer_id, txns["c"].producer_epoch, True)
    m.init_producer_id("c", 10_000)  # re-initialised after its commit: a retry is now fenced
    m.init_producer_id("a", 10_000)  # fenced and aborted
    assert plane.transaction_outcome(tg, txns["c"], [("out", 0, 0)]) == "committed"
    assert plane.transaction_outcome(tg, txns["a"], [("out", 1, 0)]) == "aborted"
    assert plane.transaction_outcome(tg, txns["o"], [("out", 2, 0)]) == "unknown"  # still open
    assert plane.transaction_outcome(tg, txns["c"], [("out", 0, 2)]) == "unknown"  # the COMMIT marker
    assert plane.transaction_outcome(tg, txns["c"], [("out", 0, 9)]) == "unknown"  # beyond the log
    assert plane.transaction_outcome(tg, txns["c"], []) == "unknown"
    assert plane.transaction_outcome(tg, txns["c"], [("out", 0, 0), ("out", 1, 0)]) == "unknown"  # disagreeing reads


def test_read_committed_stops_at_the_last_stable_offset_and_drops_aborted_records() -> None:
    m, _ = model()
    a = m.init_producer_id("a", 10_000)
    b = m.init_producer_id("b", 10_000)
    c = m.init_producer_id("c", 10_000)
    m.produce("a", *a, "out", 0, "a1")
    m.produce("b", *b, "out", 0, "b1")  # b stays open: everything from here is above the LSO
    m.produce("c", *c, "out", 0, "c1")
    m.produce("a", *a, "out", 0, "a2")
    m.end_txn("a", *a, True)
    m.end_txn("c", *c, True)
    assert m.last_stable_offset("out", 0) == (1, b[0])
    assert m.read_committed("out") == ["a1"]  # a2 and c1 committed, but they sit above the LSO
    listed = m.list_open("b")
    assert [(t.transactional_id, t.producer_id, t.producer_epoch) for t in listed] == [("b", b[0], b[1])]
    m.init_producer_id("b", 10_000)  # aborts b
    assert m.last_stable_offset("out", 0) == (m.high_watermark("out", 0), None)
    assert m.read_committed("out") == ["a1", "c1", "a2"]  # offset order; b1 dropped


# --- (c) the model agrees with the real broker ------------------------------------------------------


def test_model_and_real_kafka_agree_on_fencing_epochs_retries_timeouts_and_visibility(kafka_each_tv: RealKafka) -> None:
    """The same steps on the model and on a real broker (each transaction version): the same
    answers, the same epoch moves, the same records visible to read_committed."""
    broker = kafka_each_tv
    topic = broker.create_topic(1)
    name = f"agree-{uuid.uuid4().hex[:8]}"
    tg = KafkaTarget("agree", broker.bootstrap, 60_000)
    plane = KafkaWireControlPlane(request_timeout_ms=2_000, retry_budget_ms=4_000, retry_backoff_ms=40,
                                  retry_backoff_max_ms=200)
    m, clock = model()
    mplane = ModelControlPlane(m)

    def both_visible() -> tuple[list[str], list[str]]:
        return [x.value().decode() for x in broker.read_committed(topic)], m.read_committed(topic)

    try:
        # a producer opens a transaction and leaves; the coordinator commits it by resume, twice
        real = run_transactional_producer(broker.bootstrap, name, topic, records=2)
        mpid, mepoch = m.init_producer_id(name, 60_000)
        for i in range(2):
            m.produce(name, mpid, mepoch, topic, 0, f"record-{i}")
        plane.commit(tg, PreparedTransaction(name, real.producer_id, real.producer_epoch))
        plane.commit(tg, PreparedTransaction(name, real.producer_id, real.producer_epoch))  # retried: accepted
        mplane.commit(tg, PreparedTransaction(name, mpid, mepoch))
        mplane.commit(tg, PreparedTransaction(name, mpid, mepoch))
        assert settled_partition_log(broker.bootstrap, topic, 0).markers(real.producer_id) == ["commit"]
        assert [x.marker for x in m.logs[(topic, 0)] if x.marker] == ["COMMIT"]
        assert both_visible() == (["record-0", "record-1"], ["record-0", "record-1"])

        # a new producer on the idle id: same producer id, epoch + 1, in both
        again = run_transactional_producer(broker.bootstrap, name, topic, records=1)
        mpid2, mepoch2 = m.init_producer_id(name, 60_000)
        m.produce(name, mpid2, mepoch2, topic, 0, "record-0")
        assert (again.producer_id == real.producer_id, again.producer_epoch - real.producer_epoch) == (True, 1)
        assert (mpid2 == mpid, mepoch2 - mepoch) == (True, 1)

        # a resume with the stale epoch is refused by both with the same code, and commits nothing
        with pytest.raises(ControlPlaneError) as real_refusal:
            plane.commit(tg, PreparedTransaction(name, again.producer_id, real.producer_epoch))
        with pytest.raises(ControlPlaneError) as refused:
            mplane.commit(tg, PreparedTransaction(name, mpid2, mepoch))
        assert real_refusal.value.code == refused.value.code == "producer_fenced"
        assert partition_log(broker.bootstrap, topic, 0).has_open_transaction
        assert [t.transactional_id for t in m.list_open()] == [name]

        # InitProducerId on the id with the open transaction aborts it: the epoch moves by 2 on
        # Kafka (fence bump, then the bump of the retried InitProducerId); the model agrees
        third = run_transactional_producer(broker.bootstrap, name, topic, records=1)
        mpid3, mepoch3 = m.init_producer_id(name, 60_000)
        assert third.producer_epoch - again.producer_epoch == mepoch3 - mepoch2 == 2
        # (the abort was InitProducerId's, done before it returned; the third's transaction stays open)
        assert partition_log(broker.bootstrap, topic, 0).markers(real.producer_id) == ["commit", "abort"]
        plane.abort(tg, name)
        mplane.abort(tg, name)
        assert both_visible() == (["record-0", "record-1"], ["record-0", "record-1"])

        # abort by InitProducerId fences the live producer: its next produce is fenced
        fenced_name = name + "-f"
        live = ProducerProcess(broker.bootstrap, fenced_name, topic, stay=True)
        try:
            live.wait_ready()
            fpid, fepoch = m.init_producer_id(fenced_name, 60_000)
            m.produce(fenced_name, fpid, fepoch, topic, 0, "y")
            plane.abort(tg, fenced_name)
            mplane.abort(tg, fenced_name)
            late = live.produce_more()
            assert fenced(late), late
            with pytest.raises(KafkaError) as exc:
                m.produce(fenced_name, fpid, fepoch, topic, 0, "late")
            assert exc.value.code == "producer_fenced"
            assert settled_partition_log(broker.bootstrap, topic, 0).markers(live.stats.producer_id) == ["abort"]  # type: ignore[union-attr]
            assert [x.marker for x in m.logs[(topic, 0)] if x.marker and x.producer_id == fpid] == ["ABORT"]
        finally:
            live.close()

        # a transaction past its timeout: both abort it and refuse the late resume as fenced
        timed = name + "-t"
        late = run_transactional_producer(broker.bootstrap, timed, topic, records=1, transaction_timeout_ms=1_000)
        tpid, tepoch = m.init_producer_id(timed, 1_000)
        m.produce(timed, tpid, tepoch, topic, 0, "z")
        clock.advance(ms=1_001)
        deadline = time.monotonic() + 30
        while partition_log(broker.bootstrap, topic, 0).markers(late.producer_id) != ["abort"]:
            assert time.monotonic() < deadline, "the broker did not abort the timed-out transaction"
            time.sleep(0.3)
        with pytest.raises(ControlPlaneError) as real_late:
            plane.commit(tg, PreparedTransaction(timed, late.producer_id, late.producer_epoch))
        with pytest.raises(ControlPlaneError) as model_late:
            mplane.commit(tg, PreparedTransaction(timed, tpid, tepoch))
        assert real_late.value.code == model_late.value.code == "producer_fenced"
        assert both_visible() == (["record-0", "record-1"], ["record-0", "record-1"])
    finally:
        plane.close()


