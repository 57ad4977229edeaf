"""Issue 50 §1 on a real Apache Kafka: sinks whose cluster does not answer never starve another
sink's decided commit. Twelve sinks point at a port nobody listens on, each with a decided commit
and an abort still to do; one live sink on the real broker has a commit decided by a replica that
died before its EndTxn. The recovery loop (its thread, the real control plane) commits the live
batch within the commit reach counted from the decision, so the broker never aborts it, and a
read_committed consumer sees every record once. The landed loop ran every step of every sink in
name order: twelve dead sinks ahead of the live one cost it its transaction
(tests/service/test_recovery.py shows the one-worker variant waiting behind a hanging sink)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from fixtures.kafka_producers import run_transactional_producer
from fixtures.real_kafka import RealKafka
from fixtures.servers import free_port
from sqlalchemy import Engine

from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.kafka.wire.control_plane import KafkaWireControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.configuration import CommitReach
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import PartitionResult, PrecommitRecord
from coordinator.protocol.states import CheckpointState
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.service.recovery import RecoveryLoop

DEAD_SINKS = 12
# small settings, so a test run is short: the reach is 2.9 s, the margin 6 s of a 12 s transaction
REACH = CommitReach(request_timeout_ms=500, retry_budget_ms=1_000, leader_ttl_ms=1_000, recovery_interval_ms=200)
TIMEOUT_MS, MARGIN_MS = 12_000, 6_000


class DiesBeforeEndTxn(RecordingControlPlane):
    """The deciding replica: its decision is durable, then it dies before any EndTxn leaves it."""

    def commit_all(self, target, txns, parallelism, budget_ms=None):  # type: ignore[no-untyped-def]
        raise SystemExit("the replica died")


@pytest.mark.parametrize("finish_workers", [64, 1], ids=["a-worker-per-sink", "broken-one-shared-worker"])
def test_sinks_on_an_unreachable_cluster_never_delay_a_live_sinks_orphaned_commit(
    real_kafka: RealKafka, engine: Engine, finish_workers: int
) -> None:
    """With one worker shared by every sink's commits (the landed loop's order, the broken
    variant), the live commit waits behind the dead sinks' calls past its reach."""
    limits = Limits(commit_reach=REACH, transactional_id_quarantine_ms=200_000)
    dead_broker = f"127.0.0.1:{free_port()}"
    topic = real_kafka.create_topic(1)

    # the dead sinks: decided while their cluster still answered nothing (a recording plane failing)
    before = RecordingControlPlane()
    setup = Coordinator(engine, before, limits=limits)
    for i in range(DEAD_SINKS):
        name = f"a-dead-{i:02}"
        setup.register_sink(SinkSpec(name, f"{name}-eos", dead_broker, ["out"], transaction_timeout_ms=TIMEOUT_MS,
                                     commit_margin_ms=MARGIN_MS), "test", check_broker=False)
        gen, _ = setup.start_generation(name, "q", "r", "test")
        attempt = setup.begin_checkpoint(name, 0, gen, "test", partitions=2).attempt.number  # type: ignore[union-attr]
        won, lost = (setup.begin_partition(name, 0, attempt, gen, p, p) for p in (0, 1))
        before.fail_next(ControlPlaneError("unreachable", retriable=True, code="broker_unreachable"), times=10)
        with pytest.raises(e.Unavailable):
            setup.commit(name, 0, attempt, gen, [PartitionResult(0, won.id, PrecommitRecord(0, 7, 0, 1, 1)),
                                                 PartitionResult(1, None)], "test")
        assert lost.id  # partition 1's try lost: its abort is pending too

    # the live sink: a real transaction, decided by a replica that dies before its EndTxn
    dying = Coordinator(engine, DiesBeforeEndTxn(), limits=limits)
    dying.register_sink(SinkSpec("z-live", "z-live-eos", real_kafka.bootstrap, [topic], transaction_timeout_ms=TIMEOUT_MS,
                                 commit_margin_ms=MARGIN_MS), "test", check_broker=False)
    gen, _ = dying.start_generation("z-live", "q", "r", "test")
    attempt = dying.begin_checkpoint("z-live", 0, gen, "test", partitions=1).attempt.number  # type: ignore[union-attr]
    x = dying.begin_partition("z-live", 0, attempt, gen, 0, 42)
    st = run_transactional_producer(real_kafka.bootstrap, x.transactional_id, topic, records=3,
                                    transaction_timeout_ms=TIMEOUT_MS)
    with pytest.raises(SystemExit):
        dying.commit("z-live", 0, attempt, gen, [PartitionResult(0, x.id, PrecommitRecord(
            42, st.producer_id, st.producer_epoch, st.records, 30))], "test")
    decided = time.monotonic()
    assert [c.state for c in dying.snapshot().checkpoints if c.sink_id == dying.get_sink("z-live").id] == [
        CheckpointState.COMMITTING]

    # another replica's recovery loop, on the real control plane
    plane = KafkaWireControlPlane(request_timeout_ms=REACH.request_timeout_ms, retry_budget_ms=REACH.retry_budget_ms)
    survivor = Coordinator(engine, plane, limits=limits)
    loop = RecoveryLoop(survivor, interval_ms=REACH.recovery_interval_ms, leader_ttl_ms=REACH.leader_ttl_ms,
                        finish_grace_ms=REACH.recovery_grace_ms, sweep_interval_ms=None,
                        finish_workers=finish_workers).start()
    live = survivor.get_sink("z-live").id
    reach_s = timedelta(milliseconds=REACH.total_ms).total_seconds() + 1.0  # its reach (+ a stall of this machine)
    try:
        while (state := next(c.state for c in survivor.snapshot().checkpoints if c.sink_id == live)) \
                is CheckpointState.COMMITTING and time.monotonic() - decided < reach_s:
            time.sleep(0.05)
    finally:
        loop.stop()
        survivor.close()
    if finish_workers == 1:
        assert state is CheckpointState.COMMITTING  # still behind the dead sinks when its reach is over
        return
    assert state is CheckpointState.COMMITTED, state
    assert sorted(m.value() for m in real_kafka.read_committed(topic)) == [b"record-%d" % i for i in range(3)]
    # the dead sinks' commits are still decided, never lost: their cluster has not answered
    assert {c.state for c in survivor.snapshot().checkpoints if c.sink_id != live} == {CheckpointState.COMMITTING}
    assert check_invariants(survivor.snapshot()) == []
