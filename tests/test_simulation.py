"""The deterministic fault-injection simulation (sim/): 300 seeded schedules against the real
coordinator and Postgres with the Kafka model, the model's own rules, the model against a real
Kafka broker of each transaction version, and deliberately broken coordinators and deployments
the checker must catch.
"""

from __future__ import annotations

import logging
from datetime import timedelta
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from fixtures.kafka_producers import (
    ProducerProcess,
    fenced,
    partition_log,
    run_transactional_producer,
    settled_partition_log,
)
from fixtures.real_kafka import RealKafka
from sqlalchemy import Engine, select

from coordinator.service.clock import ManualClock
from coordinator.kafka.control_plane import (
    ControlPlaneError,
    KafkaTarget,
    PreparedTransaction,
)
from coordinator.kafka.wire.control_plane import KafkaWireControlPlane
from coordinator.protocol import rules
from coordinator.store import repo
from coordinator.store.tables import leases, transactional_ids
from sim.faults import FaultConfig
from sim.kafka_model import (
    COMPLETE_ABORT,
    COMPLETE_COMMIT,
    ONGOING,
    KafkaError,
    KafkaModel,
    ModelControlPlane,
)
from sim import runner
from sim.runner import ScheduleResult, run_one

SCHEDULES = 300


@pytest.fixture(autouse=True)
def quiet_coordinator_logs() -> Iterator[None]:
    # every injected failure is logged loudly by the service; thousands of lines slow the run
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


# --- (a) the seeded schedules ---------------------------------------------------------------------


@pytest.mark.timeout(1500)  # ~1-2 min on an idle 2-core machine, 10+ min when it is shared
def test_300_seeded_schedules_keep_every_invariant(engine: Engine) -> None:
    results = [run_one(engine, seed, FaultConfig()) for seed in range(SCHEDULES)]
    faults: Counter[str] = Counter()
    for r in results:
        faults.update(r.faults)
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results)} schedules, {sum(r.committed for r in results)} batches committed, faults: "
          + ", ".join(f"{k}={v}" for k, v in sorted(faults.items())))
    assert not bad, "\n\n".join(r.report() for r in bad[:3])
    # the faults really happened, every kind of them, at a useful rate
    for kind in ("driver_crash", "zombie_driver", "executor_crash", "speculative_task", "coordinator_crash",
                 "db_failure", "request_fail", "lost_response", "duplicate_request", "kafka_fail",
                 "kafka_lost_response", "kafka_delay", "near_timeout", "leader_failover", "two_replicas",
                 "orphaned_commit", "driver_down_long"):
        assert faults[kind] >= 10, (kind, faults)
    assert sum(r.committed for r in results) == sum(r.batches for r in results)


def test_a_seed_replays_the_same_schedule(engine: Engine) -> None:
    for seed in (3, 17, 42):
        first = run_one(engine, seed, FaultConfig(), keep_on_failure=False)
        again = run_one(engine, seed, FaultConfig(), keep_on_failure=False)
        assert first.fault_list == again.fault_list
        assert first.trace == again.trace
        assert first.fault_list, "a schedule without faults proves little"


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


# --- (d) the checker catches deliberately broken coordinators ---------------------------------------


def first_violation(engine: Engine, config: FaultConfig, seeds: range) -> ScheduleResult | None:
    for seed in seeds:
        r = run_one(engine, seed, config, keep_on_failure=False)
        if not r.ok:
            return r
    return None


def test_checker_catches_commit_without_the_timeout_gate(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "check_commit_deadlines", lambda winners, now, margin_ms: None)
    found = first_violation(engine, FaultConfig().scaled(near_timeout=0.5), range(1000, 1040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("I4", "I7", "LIVENESS")) for v in found.violations), found.report()


def test_checker_catches_re_leasing_an_id_that_holds_an_open_transaction(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = repo.take_free_transactional_ids

    def leaky(conn, sink, n, now, prefix_for, locked=()):  # type: ignore[no-untyped-def]
        held = conn.execute(
            select(transactional_ids.c.id, transactional_ids.c.transactional_id)
            .join(leases, leases.c.id == transactional_ids.c.lease_id)
            .where(transactional_ids.c.sink_id == sink.id, leases.c.state.in_(["LEASED", "PRECOMMITTED"]))
            .order_by(transactional_ids.c.ordinal).limit(1)
        ).first()
        if held is not None:
            rest = original(conn, sink, n - 1, now, prefix_for, locked=list(locked)[:n - 1]) if n > 1 else []
            return [(held.id, held.transactional_id), *rest]
        return original(conn, sink, n, now, prefix_for, locked=locked)

    monkeypatch.setattr(repo, "take_free_transactional_ids", leaky)
    found = first_violation(engine, FaultConfig(), range(2000, 2040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("I3", "I7", "I2")) for v in found.violations), found.report()


def test_checker_catches_a_stale_generation_being_accepted(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "check_generation", lambda current, given: None)
    found = first_violation(engine, FaultConfig().scaled(driver_crash=0.1, zombie_driver=1.0), range(3000, 3040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("I5") for v in found.violations), found.report()


def test_checker_catches_a_coordinator_that_never_aborts_on_kafka(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """I6 is checked while transactions can still be open (before quiescence moves the clock past
    every timeout, after which the broker has expired everything and I6 could never fail)."""
    monkeypatch.setattr(ModelControlPlane, "abort", lambda self, target, transactional_id: None)
    found = first_violation(engine, FaultConfig(), range(4000, 4040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("I6: open transactions no unresolved lease explains") for v in found.violations), \
        found.report()


def test_checker_catches_a_recovery_step_that_fails_on_first_tries(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails on the common path's first tries, whose lease ids are beyond 32 bits (the
    near-timeout step read them as 32-bit integers and failed on every pass after a warning; the
    schedules do not reach that step, so the pending aborts stand in). Its transactions may still
    end (Spark retries, the broker's timeout), so the invariants need not break: the checker flags
    a step error that no injected fault explains."""
    from coordinator.protocol.states import ABORT_PENDING_STATES
    from coordinator.service.recovery_operations import RecoveryOperations

    original = RecoveryOperations.run_pending_aborts

    def int32_ids(self, name):  # type: ignore[no-untyped-def]
        if any(x.id >= 2**31 for x in self.possibly_open_transactions(name) if x.state in ABORT_PENDING_STATES):
            raise ValueError("value out of range for type integer")
        return original(self, name)

    monkeypatch.setattr(RecoveryOperations, "run_pending_aborts", int32_ids)
    found = first_violation(engine, FaultConfig(), range(6000, 6040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("RECOVERY: step pending_aborts failed with what no fault explains: ValueError")
               for v in found.violations), found.report()


# --- (e) issue 15: each finding as a fault kind -----------------------------------------------------


def only(kind: str, rate: float) -> FaultConfig:
    return FaultConfig().scaled(**{kind: rate})


def test_unexpected_end_txn_errors_keep_every_invariant(engine: Engine) -> None:
    """Item 4: UNKNOWN_SERVER_ERROR, an authorization failure or an unknown code on EndTxn keeps the
    commit decided; it is retried and nothing is lost."""
    config = only("kafka_unexpected_error", 0.3)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(5000, 5020)]
    assert sum(r.faults["kafka_unexpected_error"] for r in results) >= 10
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_treating_every_refusal_as_final(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 4's broken variant: any non-retriable answer ends the commit (the landed code before the fix).
    The log check before LOST (item 5) would find such a transaction still open and keep the commit,
    so it is switched off too: this is the landed code's behaviour, which declared LOST at once."""
    monkeypatch.setattr(ControlPlaneError, "transaction_gone", property(lambda self: not self.retriable))
    monkeypatch.setattr("coordinator.service.base._first_offsets", lambda lease: [])
    found = first_violation(engine, only("kafka_unexpected_error", 0.3), range(5000, 5040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("LOST", "FALSE LOST")) for v in found.violations), found.report()


# Items 1, 2, 3 and 5: with the fixes (quarantine of ids freed from undecided tries longer than a
# stalled try can reach the broker, one clock, offsets bound at begin, first offsets in the
# pre-commit record) the fault kind loses nothing; with each fix disabled the checker finds the loss.


def first_violation_kw(engine: Engine, config: FaultConfig, seeds: range, **kw: object) -> ScheduleResult | None:
    for seed in seeds:
        r = run_one(engine, seed, config, keep_on_failure=False, **kw)
        if not r.ok:
            return r
    return None


def test_checker_catches_ids_reused_without_quarantine(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.service.results import Limits

    monkeypatch.setattr(rules, "validate_quarantine", lambda *a: None)
    monkeypatch.setattr(Limits, "quarantine", property(lambda self: timedelta(0)))
    outcome = ("LOST", "I7", "LIVENESS")  # what a zombie did to the output (R1, on the record, flags it earlier)
    found = next((r for seed in range(6000, 6060) for r in [run_one(engine, seed, only("zombie_executor", 0.25),
                  keep_on_failure=False)] if any(v.startswith(outcome) for v in r.violations)), None)
    assert found is not None, "no loss within 60 seeds"


def test_the_reuse_check_flags_an_id_leased_again_within_reach_whatever_kafka_saw(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R1 reads the record alone: with the quarantine off, an id freed from an undecided try and
    leased again within the reach of a stalled try is flagged even in schedules where no zombie
    happened to act (the outcome checks above need one to); with the quarantine on it never is."""
    from coordinator.service.results import Limits

    config = only("zombie_executor", 0.25)
    kept = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(6100, 6110)]
    assert not [v for r in kept for v in r.violations if v.startswith("R1")]
    monkeypatch.setattr(rules, "validate_quarantine", lambda *a: None)
    monkeypatch.setattr(Limits, "quarantine", property(lambda self: timedelta(0)))
    found = first_violation(engine, config, range(6100, 6160))
    assert found is not None, "no violation within 60 seeds"
    assert any(v.startswith("R1") for v in found.violations), found.report()


def loop_finishes(result: ScheduleResult) -> int:
    """How many times the schedule's recovery loop committed a decision while the driver was down."""
    return sum(1 for line in result.trace if "recovery (" in line and "while the driver is down" in line
               and "committed=" in line)


def test_the_recovery_loop_finishes_an_orphaned_commit_within_the_timeout(engine: Engine) -> None:
    """The driver dies with its commit in flight, the replica deciding it dies too, and the driver
    stays down past the transaction timeout: the loop (after its grace) is the only one to finish
    the decision, and must before the broker aborts it."""
    config = FaultConfig().scaled(orphaned_commit=0.3, driver_down_long=0.5)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(9500, 9530)]
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()
    assert sum(loop_finishes(r) for r in results) >= 3, "the loop never finished an orphaned commit"


def test_checker_catches_a_recovery_grace_past_the_transaction_timeout(engine: Engine) -> None:
    """The broken variant: the loop leaves decisions to their (dead) callers for longer than the
    transaction timeout, so the broker aborts them first and the decided batches are lost."""
    config = FaultConfig().scaled(orphaned_commit=0.3, driver_down_long=0.5)
    found = first_violation_kw(engine, config, range(9500, 9540),
                               recovery_grace_ms=runner.TIMEOUT_MS + runner.MARGIN_MS)
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith(("LOST", "I4", "I7")) for v in found.violations), found.report()


def test_checker_catches_replicas_deciding_on_their_own_clocks(engine: Engine) -> None:
    found = first_violation_kw(engine, only("clock_skew", 1.0).scaled(two_replicas=1.0), range(7000, 7040),
                               one_clock=False)
    assert found is not None, "no violation within 40 seeds"


def test_checker_catches_a_replay_over_other_offsets_being_skipped(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "check_offsets", lambda *a: None)
    found = first_violation(engine, only("checkpoint_restore", 0.5), range(8000, 8040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("I7") for v in found.violations), found.report()


def test_checker_catches_a_loss_declared_without_reading_the_log(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("coordinator.service.base._first_offsets", lambda lease: [])
    found = first_violation(engine, only("end_txn_lost_reinit", 0.2), range(9000, 9040))
    assert found is not None, "no violation within 40 seeds"
    assert any(v.startswith("FALSE LOST") for v in found.violations), found.report()


def test_stalled_executors_whose_init_lands_late_lose_nothing(engine: Engine) -> None:
    found = first_violation(engine, only("zombie_executor", 0.25), range(6000, 6040))
    assert found is None, found.report()


def test_a_lost_stage_attempt_whose_first_tries_wrote_or_stalled_loses_nothing(engine: Engine) -> None:
    """Issue 12's new failure point: a stage retry after the first tries ran on their pre-leases
    (some wrote and were thrown away, some stalled before InitProducerId and land later)."""
    results = [run_one(engine, seed, only("stage_retry", 0.4), keep_on_failure=False) for seed in range(6200, 6230)]
    assert sum(r.faults.get("stage_retry", 0) for r in results) >= 10
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_a_stage_retry_reusing_the_first_tries_pre_leases(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken variant: a re-run stage's task attempt 0 counted as a first try, so it writes on
    the pre-lease that stage attempt 0's stalled try still holds; the zombie's InitProducerId then
    fences the winner."""
    import sim.spark

    monkeypatch.setattr(sim.spark, "is_first_try", lambda stage_attempt, task_attempt: task_attempt == 0)
    found = first_violation(engine, only("stage_retry", 0.4), range(6200, 6260))
    assert found is not None, "no violation within 60 seeds"
    assert any(v.startswith(("LOST", "I7", "LIVENESS")) for v in found.violations), found.report()


def test_replica_clock_skew_and_steps_lose_nothing(engine: Engine) -> None:
    found = first_violation(engine, only("clock_skew", 1.0).scaled(two_replicas=1.0), range(7000, 7030))
    assert found is None, found.report()


def test_a_checkpoint_restored_from_an_older_backup_loses_nothing(engine: Engine) -> None:
    found = first_violation(engine, only("checkpoint_restore", 0.5), range(8000, 8030))
    assert found is None, found.report()


def test_a_commit_applied_whose_answer_was_lost_before_a_re_init_is_not_declared_lost(engine: Engine) -> None:
    found = first_violation(engine, only("end_txn_lost_reinit", 0.2), range(9000, 9030))
    assert found is None, found.report()


def test_checker_catches_first_tries_copied_to_lease_rows_instead_of_moved(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The storage layout's broken variant (migration 0012): materialising copies a batch's first
    tries into lease_rows but leaves them on the attempt row too, so each is counted twice."""
    from sqlalchemy import text

    from coordinator.store.tables import lease_rows

    columns = ", ".join(c.name for c in lease_rows.c)

    def copy_only(conn, attempt_ids):  # type: ignore[no-untyped-def]
        conn.execute(text(
            f"INSERT INTO lease_rows ({columns}) SELECT {columns} FROM first_try_leases f "
            "WHERE f.attempt_id = ANY(CAST(:ids AS bigint[])) AND NOT EXISTS (SELECT 1 FROM lease_rows r WHERE r.id = f.id)"
        ), {"ids": sorted(set(attempt_ids))})

    monkeypatch.setattr(repo, "materialize_first_tries", copy_only)
    # an attempt ended otherwise than committed trips the CHECK on its row; the check finds the rest
    for seed in range(7000, 7040):
        found = run_one(engine, seed, FaultConfig(), keep_on_failure=False)
        if any(v.startswith("S1") for v in found.violations):
            return
    raise AssertionError("no S1 violation within 40 seeds")


def test_pruning_the_history_between_any_two_steps_loses_nothing(engine: Engine) -> None:
    """An operator prunes old batches' history at any point (faults inside it too), while Spark's
    checkpoint may be restored from an older backup: a replay of a pruned batch is still skipped
    as committed, or refused when re-planned over other offsets."""
    config = only("history_prune", 0.6).scaled(checkpoint_restore=0.5)
    results = [run_one(engine, seed, config, keep_on_failure=False) for seed in range(8100, 8130)]
    assert sum(r.faults.get("history_prune", 0) for r in results) >= 20
    assert sum(r.faults.get("checkpoint_restore", 0) for r in results) >= 5
    bad = [r for r in results if not r.ok]
    assert not bad, bad[0].report()


def test_checker_catches_pruning_that_deletes_the_checkpoint_rows_too(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken variant: pruning deletes a batch's checkpoint row with its history, so a replay
    of the batch after a checkpoint restore finds no record of it and writes it again."""
    from sqlalchemy import text

    import coordinator.service.history as history

    real_prune = history.HistoryOperations.prune_history

    def prune_and_delete_rows(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        outcome = real_prune(self, *args, **kwargs)
        with self.engine.begin() as conn:  # the rows whose history is gone go as well
            conn.execute(text("DELETE FROM checkpoints WHERE history_pruned_at IS NOT NULL"))
        return outcome

    monkeypatch.setattr(history.HistoryOperations, "prune_history", prune_and_delete_rows)
    config = only("history_prune", 0.6).scaled(checkpoint_restore=0.5)
    failed = [r for r in (run_one(engine, seed, config) for seed in range(8100, 8160)) if not r.ok]
    # every such schedule has a committed checkpoint vanish (I1's history half); and some write a
    # replayed batch twice (I7: the records visible more than once)
    assert failed, "no violation within 60 seeds"
    assert all(any(v.startswith("I1: committed checkpoint") for v in r.violations) for r in failed), failed[0].report()
    assert any(any(v.startswith("I7: records visible more than once") for v in r.violations) for r in failed), \
        failed[0].report()
