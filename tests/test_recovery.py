"""The recovery loop (DESIGN.md §3 step 6) on a real Postgres with the record-only Kafka control
plane (its `open_transactions` stands in for the broker's KIP-664 answers) and a manual clock:
leader election by lease row and fencing token, finishing decided commits without the driver,
aborting expired leases and lingering transactions (never racing a lease grant), warnings at
80 % of a pre-committed transaction's lifetime, scale-down, per-step backoff, and the pure
decisions in coordinator/protocol/recovery_rules.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, event, select, text

from coordinator.service.clock import ManualClock
from coordinator.kafka.control_plane import (
    ControlPlaneError,
    OpenTransaction,
    RecordingControlPlane,
)
from coordinator.protocol import errors as e
from coordinator.protocol import recovery_rules, rules
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import Lease, PrecommitRecord
from coordinator.protocol.model import PartitionResult as PR
from coordinator.protocol.rules import BeginAction, PrecommitRequest
from coordinator.protocol.states import (
    AttemptState,
    CheckpointState,
    LeaseState,
    TransactionalIdState,
)
from coordinator.service.recovery import LeaderLease, RecoveryLoop
from coordinator.service.recovery_operations import NAMED_IN_LOG
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.store.tables import transactional_ids

NAME = "clicks"
PREFIX = "clicks-eos"
ACTOR = "test"
TIMEOUT_MS = 60_000
MARGIN_MS = 6_000
UNREACHABLE = ControlPlaneError("broker unreachable", retriable=True, code="network_exception")


def metric(name: str, sink: str = NAME) -> float:
    return REGISTRY.get_sample_value(name, {"sink": sink}) or 0.0


def start(c: Coordinator, name: str = NAME, prefix: str = PREFIX) -> int:
    c.register_sink(SinkSpec(name=name, transactional_id_prefix=prefix, bootstrap_servers="kafka:9092",
                             topics=["out"], transaction_timeout_ms=TIMEOUT_MS), ACTOR)
    gen, _ = c.start_generation(name, "query-1", "run-1", ACTOR)
    return gen


def begin(c: Coordinator, gen: int, batch: int, name: str = NAME) -> int:
    r = c.begin_checkpoint(name, batch, gen, ACTOR)
    assert r.action is BeginAction.NEW_ATTEMPT and r.attempt is not None
    return r.attempt.number


def lease(c: Coordinator, gen: int, batch: int, attempt: int, partition: int, *, precommit: bool = True,
          name: str = NAME) -> Lease:
    x = c.begin_partition(name, batch, attempt, gen, partition, 1000 * attempt + partition)
    if precommit:
        x = c.precommit(name, x.id, gen, PrecommitRequest(9000 + x.id, 0, 5, 500))
    return x


def open_txn(tid: str, producer_id: int = 1) -> OpenTransaction:
    return OpenTransaction(tid, producer_id, 0, "Ongoing", None, TIMEOUT_MS, (("out", 0),))


def states(c: Coordinator) -> dict[int, LeaseState]:
    return {x.id: x.state for x in c.snapshot().leases}


def pool(c: Coordinator) -> dict[str, TransactionalIdState]:
    return {t.transactional_id: t.state for t in c.snapshot().transactional_ids}


def kinds(c: Coordinator, name: str = NAME) -> list[str]:
    return [ev["kind"] for ev in c.list_events(name, limit=1000)]


def decided_on_a_silent_broker(c: Coordinator, kafka: RecordingControlPlane, gen: int, batch: int) -> list[Lease]:
    """A two-partition batch on the common path (first tries on the attempt's row), its commit
    decided while the broker answers nothing (it stays so until kafka.clear_failures()): COMMITTING."""
    begun = c.begin_checkpoint(NAME, batch, gen, ACTOR, partitions=2)
    kafka.fail_next(UNREACHABLE, times=1000)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, batch, begun.attempt.number, gen,
                 [PR(x.partition, x.id, PrecommitRecord(500 + x.partition, 0, 5, 50)) for x in begun.pre_leases], ACTOR)
    return begun.pre_leases


def assert_invariants(c: Coordinator, *, settled: bool = True) -> None:
    violations = check_invariants(c.snapshot(), settled=settled)
    assert violations == [], [str(v) for v in violations]


@pytest.fixture
def loop(coordinator: Coordinator) -> Iterator[RecoveryLoop]:
    r = RecoveryLoop(coordinator, interval_ms=50, leader_ttl_ms=10_000, holder="replica-a")
    yield r
    r.stop()


# --- leader election -------------------------------------------------------------------------


def test_one_leader_among_two_and_the_other_takes_over_when_it_stops_renewing(
    engine: Engine, kafka: RecordingControlPlane
) -> None:
    # each replica has its own coordinator (and clocks far apart: leadership uses the database's)
    a_coord = Coordinator(engine, kafka, clock=ManualClock())
    b_coord = Coordinator(engine, kafka, clock=ManualClock(ManualClock().now() + timedelta(days=3)))
    # a TTL well beyond a stall of this shared machine (with 800 ms, a stall between two of a's
    # renewals in a loaded CI run let b take over), so only a's stopping hands it over
    a = RecoveryLoop(a_coord, interval_ms=100, leader_ttl_ms=3000, holder="replica-a")
    b = RecoveryLoop(b_coord, interval_ms=100, leader_ttl_ms=3000, holder="replica-b")
    try:
        first = a.run_once()
        assert first.leader and first.token is not None
        for _ in range(5):  # the leader keeps renewing: the other never leads
            assert not b.run_once().leader
            assert a.run_once().token == first.token
            time.sleep(0.1)
        row = a.lease.current()
        assert row is not None and row["holder"] == "replica-a" and row["live"] and row["token"] == first.token

        deadline = time.monotonic() + 10
        taken = b.run_once()
        while not taken.leader:  # a stopped renewing: b takes over once the lease expired
            assert time.monotonic() < deadline, "b never took over"
            time.sleep(0.05)
            taken = b.run_once()
        assert taken.token == first.token + 1  # a new holder, a new fencing token
        assert not a.run_once().leader and not a.is_leader and b.is_leader
        assert b.lease.current()["holder"] == "replica-b"  # type: ignore[index]

        # a graceful stop gives the lease up at once
        b.stop()
        assert b.lease.current()["live"] is False  # type: ignore[index]
        again = a.run_once()
        assert again.leader and again.token == first.token + 2
    finally:
        a.stop()
        b.stop()
        a_coord.close()
        b_coord.close()


def test_leader_lease_is_exclusive_under_concurrent_acquires(engine: Engine) -> None:
    leases = [LeaderLease(engine, f"replica-{i}", 5_000) for i in range(8)]
    with ThreadPoolExecutor(8) as pool_:
        tokens = list(pool_.map(lambda x: x.acquire(), leases))
    assert sum(t is not None for t in tokens) == 1


def test_ttl_must_exceed_the_interval(coordinator: Coordinator) -> None:
    with pytest.raises(ValueError, match="must exceed"):
        RecoveryLoop(coordinator, interval_ms=5_000, leader_ttl_ms=5_000)


# --- finishing decided commits ---------------------------------------------------------------


def test_run_once_finishes_a_decided_commit_without_the_driver(
    coordinator: Coordinator, kafka: RecordingControlPlane, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    w0, w1 = lease(c, gen, 0, attempt, 0), lease(c, gen, 0, attempt, 1)
    loser = c.begin_partition(NAME, 0, attempt, gen, 1, 99)  # a speculative copy that lost
    kafka.fail_next(UNREACHABLE, times=3)  # both commits and the loser's abort fail: the driver gives up
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, [PR(0, w0.id), PR(1, w1.id)], ACTOR)
    kafka.clear_failures()  # the broker is back (after the first failure the commit tried no other winner)
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING
    assert states(c)[loser.id] is LeaseState.ABORTING
    finished_before = metric("coordinator_recovery_commits_finished_total")

    report = loop.run_once()

    r = report.sinks[NAME]
    assert report.leader and r.committed == [0] and r.errors == {}
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTED
    assert {t.transactional_id for _, t in kafka.commits} == {w0.transactional_id, w1.transactional_id}
    assert states(c)[loser.id] is LeaseState.ABORTED and (NAME, loser.transactional_id) in kafka.aborts
    assert set(pool(c).values()) == {TransactionalIdState.FREE}
    # the trail says recovery finished it: the batch's decision, then the recovery's committed mark
    trail = [(ev["kind"], ev["actor"]) for ev in c.list_events(NAME, batch_id=0, limit=1000)]
    assert [x for x in trail if x[0] in ("commit_decided", "checkpoint_committed")] == [
        ("commit_decided", ACTOR), ("checkpoint_committed", "recovery")]
    (done,) = [ev for ev in c.list_events(NAME, batch_id=0, limit=1000) if ev["kind"] == "checkpoint_committed"]
    assert done["detail"] == {"batch_id": 0, "attempt": attempt, "by": "recovery_loop"}
    assert_invariants(c)
    # nothing left: the next iteration does nothing
    calls = (len(kafka.commits), len(kafka.aborts))
    assert loop.run_once().sinks[NAME].committed == []
    assert (len(kafka.commits), len(kafka.aborts)) == calls
    assert metric("coordinator_recovery_commits_finished_total") == finished_before + 1


def test_a_commit_decided_within_the_grace_is_left_to_the_call_deciding_it(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
) -> None:
    """The service's loop leaves a decision younger than its commit reach's recovery grace alone
    (the deciding call still retries its EndTxn; the loop's would race it): the loop does not even
    find it due, and the finishing operation passes it over; once the grace is over, both act."""
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    w0 = lease(c, gen, 0, attempt, 0)
    kafka.fail_next(UNREACHABLE, times=1)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, [PR(0, w0.id)], ACTOR)
    grace_ms = 5_000
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000, holder="replica-g", finish_grace_ms=grace_ms)
    sent = len(kafka.commits)

    clock.advance(ms=grace_ms - 1)
    assert [due for name, _, due in loop._sinks_due() if name == NAME] == [set()]
    assert c.finish_decided_commits(NAME, grace_ms).committed == []
    r = loop.run_once().sinks[NAME]
    assert r.committed == [] and r.errors == {} and len(kafka.commits) == sent
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING

    clock.advance(ms=1)
    assert [due for name, _, due in loop._sinks_due() if name == NAME] == [{"finish"}]
    r = loop.run_once().sinks[NAME]
    assert r.committed == [0] and len(kafka.commits) == sent + 1
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTED
    assert_invariants(c)


def test_the_recovery_grace_keeps_a_decided_commit_within_its_reach() -> None:
    """The loop starts on a decision at most grace + failover after it, and its request lands
    within the request timeout: no later than the reach every commit margin exceeds."""
    reach = rules.CommitReach(request_timeout_ms=4_000, retry_budget_ms=8_000, leader_ttl_ms=6_000,
                              recovery_interval_ms=2_000)
    assert 0 < reach.recovery_grace_ms
    assert reach.recovery_grace_ms + reach.failover_ms + reach.request_timeout_ms <= reach.total_ms


def test_run_once_reports_a_commit_refused_for_good_as_lost(
    coordinator: Coordinator, kafka: RecordingControlPlane, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    w = lease(c, gen, 0, attempt, 0)
    kafka.fail_next(UNREACHABLE)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, [PR(0, w.id)], ACTOR)
    kafka.fail_next(ControlPlaneError("fenced", retriable=False, code="producer_fenced"))

    r = loop.run_once().sinks[NAME]

    assert r.lost == [0] and r.committed == [] and "finish" not in r.errors
    assert c.snapshot().checkpoints[0].state is CheckpointState.LOST
    assert c.get_sink(NAME).halted and "data_lost" in kinds(c)
    assert states(c)[w.id] is LeaseState.LOST and (NAME, w.transactional_id) in kafka.aborts
    assert_invariants(c)
    # the halt holds until acknowledged; the loop keeps working meanwhile
    with pytest.raises(e.Conflict) as exc:
        c.begin_checkpoint(NAME, 1, gen, ACTOR)
    assert exc.value.reason == e.SINK_HALTED_LOST_DATA
    assert loop.run_once().sinks[NAME].errors == {}


def test_an_unexpected_broker_error_keeps_the_commit_decided_with_backoff_and_never_aborts_it(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    """Issue 15 item 4: UNKNOWN_SERVER_ERROR (or an authorization failure after an ACL change) is
    not a refusal that ends a transaction: the loop backs off and tries again; nothing is lost."""
    c = coordinator
    now = [0.0]
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000, holder="replica-a", monotonic=lambda: now[0])
    gen = start(c)
    attempt = begin(c, gen, 0)
    w = lease(c, gen, 0, attempt, 0)
    odd = ControlPlaneError("EndTxn: broker answered UNKNOWN_SERVER_ERROR", retriable=False, code="unknown_server_error")
    kafka.fail_next(odd, times=2)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, [PR(0, w.id)], ACTOR)

    r = loop.run_once(honor_backoff=True).sinks[NAME]
    assert r.lost == [] and r.committed == [] and 0 in r.commit_pending and "UNKNOWN_SERVER_ERROR" in r.errors["finish"]
    assert "finish" in loop.run_once(honor_backoff=True).sinks[NAME].skipped  # backing off
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING and not c.get_sink(NAME).halted
    assert kafka.aborts == [] and "data_lost" not in kinds(c)

    now[0] += 60  # the backoff is over, and the broker answers again
    r = loop.run_once(honor_backoff=True).sinks[NAME]
    assert r.committed == [0] and c.snapshot().checkpoints[0].state is CheckpointState.COMMITTED
    assert_invariants(c)


# --- expired leases --------------------------------------------------------------------------


def test_run_once_aborts_leases_that_can_no_longer_pass_the_commit_gate(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    dead_task = lease(c, gen, 0, attempt, 0, precommit=False)  # an executor died mid-write
    precommitted = lease(c, gen, 0, attempt, 1)  # the driver never came to commit
    clock.advance(ms=TIMEOUT_MS - MARGIN_MS)
    assert loop.run_once().sinks[NAME].expired == []  # exactly the margin left: the gate still passes
    fresh = lease(c, gen, 0, attempt, 2, precommit=False)  # a retried task, just leased
    clock.advance(ms=1)
    expired_before = metric("coordinator_expired_leases_aborted_total")

    r = loop.run_once().sinks[NAME]

    assert sorted(r.expired) == sorted([dead_task.transactional_id, precommitted.transactional_id])
    assert sorted(r.aborted) == sorted(r.expired)
    now = states(c)
    assert now[dead_task.id] is LeaseState.ABORTED and now[precommitted.id] is LeaseState.ABORTED
    assert now[fresh.id] is LeaseState.LEASED
    assert {t for _, t in kafka.aborts} == {dead_task.transactional_id, precommitted.transactional_id}
    p = pool(c)
    assert p[dead_task.transactional_id] is TransactionalIdState.FREE  # freed only after the abort
    assert p[fresh.transactional_id] is TransactionalIdState.LEASED
    assert "expired_leases_aborted" in kinds(c)
    assert metric("coordinator_expired_leases_aborted_total") == expired_before + 2
    assert c.snapshot().attempts[0].state is AttemptState.OPEN  # the attempt itself may still commit
    assert_invariants(c)

    # the driver naming the expired winner is refused as the timeout gate refuses it: replay
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, attempt, gen, [PR(0, None), PR(1, precommitted.id), PR(2, None)], ACTOR)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE
    assert c.snapshot().attempts[0].state is AttemptState.ABORTED
    assert_invariants(c, settled=False)


def test_expired_lease_abort_waits_for_kafka(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    dead = lease(c, gen, 0, attempt, 0, precommit=False)
    clock.advance(ms=TIMEOUT_MS)
    kafka.fail_next(UNREACHABLE)

    r = loop.run_once().sinks[NAME]
    assert r.expired == [dead.transactional_id] and r.abort_pending == [dead.transactional_id]
    assert states(c)[dead.id] is LeaseState.ABORTING
    assert pool(c)[dead.transactional_id] is TransactionalIdState.LEASED  # not handed out meanwhile (I3)
    other = lease(c, gen, 0, attempt, 1, precommit=False)
    assert other.transactional_id != dead.transactional_id

    r = loop.run_once().sinks[NAME]  # Kafka is back: the pending abort is done
    assert r.aborted == [dead.transactional_id] and states(c)[dead.id] is LeaseState.ABORTED
    assert pool(c)[dead.transactional_id] is TransactionalIdState.FREE
    assert_invariants(c)


# --- warnings --------------------------------------------------------------------------------


def test_warns_once_at_80_percent_of_a_precommitted_transactions_lifetime(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    w = lease(c, gen, 0, attempt, 0)
    unflushed = lease(c, gen, 0, attempt, 1, precommit=False)  # not pre-committed: no warning
    clock.advance(ms=int(TIMEOUT_MS * 0.8) - 1)
    assert loop.run_once().sinks[NAME].warned == []
    warnings_before = metric("coordinator_transaction_timeout_warnings_total")
    clock.advance(ms=1)

    r = loop.run_once().sinks[NAME]
    assert r.warned == [w.transactional_id] and r.near_timeout == [w.transactional_id]
    assert unflushed.transactional_id not in r.near_timeout
    (ev,) = [x for x in c.list_events(NAME, limit=1000) if x["kind"] == "transaction_near_timeout"]
    assert ev["batch_id"] == 0 and ev["detail"]["count"] == 1 and ev["detail"]["fraction"] == 0.8
    assert ev["detail"]["leases"] == [[w.id, 0, w.transactional_id, "PRECOMMITTED", 0.8,
                                       TIMEOUT_MS - int(TIMEOUT_MS * 0.8)]]
    assert metric("coordinator_transaction_timeout_warnings_total") == warnings_before + 1
    assert metric("coordinator_transactions_near_timeout") == 1

    clock.advance(ms=1_000)
    again = loop.run_once().sinks[NAME]  # still near its timeout, but warned once only
    assert again.warned == [] and again.near_timeout == [w.transactional_id]
    assert kinds(c).count("transaction_near_timeout") == 1
    # still outside the margin: the commit goes through
    result = c.commit(NAME, 0, attempt, gen, [PR(0, w.id), PR(1, None)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert loop.run_once().sinks[NAME].near_timeout == []
    assert metric("coordinator_transactions_near_timeout") == 0


def test_a_wide_batch_past_80_percent_is_one_warning_line_naming_a_few(
    coordinator: Coordinator, clock: ManualClock, loop: RecoveryLoop, caplog: pytest.LogCaptureFixture
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    live = [lease(c, gen, 0, attempt, p) for p in range(NAMED_IN_LOG + 3)]
    clock.advance(ms=int(TIMEOUT_MS * 0.8))
    with caplog.at_level(logging.WARNING, logger="coordinator.service"):
        assert len(loop.run_once().sinks[NAME].warned) == len(live)
    lines = [r.getMessage() for r in caplog.records if "past 80%" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"sink {NAME}: {len(live)} transaction(s) newly past 80% of their timeout: "
                               f"{live[0].transactional_id} (lease {live[0].id}, PRECOMMITTED), ")
    assert lines[0].endswith(" and 3 more") and live[NAMED_IN_LOG].transactional_id not in lines[0]


def test_a_wide_batch_past_80_percent_is_one_event_and_a_later_one_another(
    coordinator: Coordinator, clock: ManualClock, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    early = [lease(c, gen, 0, attempt, p) for p in range(30)]
    clock.advance(ms=TIMEOUT_MS // 2)
    late = lease(c, gen, 0, attempt, 30)  # its transaction started half a timeout later
    clock.advance(ms=int(TIMEOUT_MS * 0.3))

    assert len(loop.run_once().sinks[NAME].warned) == len(early)
    (ev,) = [x for x in c.list_events(NAME, limit=1000) if x["kind"] == "transaction_near_timeout"]
    assert ev["detail"]["count"] == len(early) and [x[0] for x in ev["detail"]["leases"]] == [x.id for x in early]
    clock.advance(ms=1_000)
    assert loop.run_once().sinks[NAME].warned == []  # the event is the record of who was warned
    clock.advance(ms=TIMEOUT_MS // 2)
    r = loop.run_once().sinks[NAME]
    assert r.warned == [late.transactional_id]  # (the early ones are past their timeout now: aborted)
    warnings = [x for x in c.list_events(NAME, limit=1000) if x["kind"] == "transaction_near_timeout"]
    assert [x["detail"]["count"] for x in warnings] == [len(early), 1]
    assert warnings[1]["detail"]["leases"][0][:4] == [late.id, 30, late.transactional_id, "PRECOMMITTED"]


def test_first_tries_near_their_timeout_are_warned_once_whatever_their_ids(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    """A first try's lease id encodes its attempt's (far beyond 32 bits): the check for warnings
    already given read lease ids as integers and failed on every pass after the first."""
    c = coordinator
    gen = start(c)
    firsts = decided_on_a_silent_broker(c, kafka, gen, 0)
    assert min(x.id for x in firsts) > 2**31
    clock.advance(ms=int(TIMEOUT_MS * 0.8))
    first = loop.run_once().sinks[NAME]
    assert first.warned == [x.transactional_id for x in firsts] and "near_timeout" not in first.errors
    clock.advance(ms=1_000)
    again = loop.run_once().sinks[NAME]
    assert "near_timeout" not in again.errors and again.warned == [] and len(again.near_timeout) == 2
    kafka.clear_failures()


def test_every_step_of_the_loop_works_on_first_tries(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    """The two-call protocol's common path: leases that are first tries on their attempt's row,
    with ids beyond 32 bits. The sweep finds their open transactions explained, an abandoned
    batch's are aborted once they can no longer pass the commit gate, a decided batch's are
    committed once Kafka answers, and no step fails on the way."""
    c = coordinator
    gen = start(c)
    abandoned = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2).pre_leases
    kafka.open_transactions = [open_txn(x.transactional_id) for x in abandoned]  # the tasks are writing
    r = loop.run_once().sinks[NAME]
    assert r.errors == {} and r.lingering_found == [] and r.expired == []  # their leases explain them
    clock.advance(ms=TIMEOUT_MS - MARGIN_MS + 1)  # past the commit gate: the driver is gone
    r = loop.run_once().sinks[NAME]
    assert r.errors == {} and sorted(r.expired) == sorted(r.aborted) == sorted(x.transactional_id for x in abandoned)
    assert {x.id: states(c)[x.id] for x in abandoned} == {x.id: LeaseState.ABORTED for x in abandoned}

    kafka.open_transactions = []
    decided = decided_on_a_silent_broker(c, kafka, gen, 1)
    kafka.clear_failures()  # the broker is back
    r = loop.run_once().sinks[NAME]
    assert r.errors == {} and r.committed == [1]
    assert {states(c)[x.id] for x in decided} == {LeaseState.COMMITTED}
    assert_invariants(c)


def test_a_warning_recorded_one_lease_per_event_still_counts(
    coordinator: Coordinator, engine: Engine, clock: ManualClock, loop: RecoveryLoop
) -> None:
    """Events written before a warning listed its batch's leases named one lease each."""
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    old, new = lease(c, gen, 0, attempt, 0), lease(c, gen, 0, attempt, 1)
    c.record_operator_event(NAME, "transaction_near_timeout", "recovery", batch_id=0, lease_id=old.id,
                            transactional_id=old.transactional_id, state="PRECOMMITTED", age_fraction=0.8,
                            remaining_ms=12_000)
    clock.advance(ms=int(TIMEOUT_MS * 0.8))
    assert loop.run_once().sinks[NAME].warned == [new.transactional_id]


# --- lingering transactions ------------------------------------------------------------------


def test_sweep_aborts_exactly_the_open_transactions_the_database_does_not_explain(
    coordinator: Coordinator, kafka: RecordingControlPlane, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    c.register_sink(SinkSpec(name="other", transactional_id_prefix="views-eos", bootstrap_servers="kafka:9092",
                             topics=["v"]), ACTOR)
    attempt = begin(c, gen, 0)
    held = [lease(c, gen, 0, attempt, p) for p in range(2)]  # explained: their leases are unresolved
    in_flight = lease(c, gen, 0, attempt, 2, precommit=False)
    done = c.begin_checkpoint(NAME, 1, gen, ACTOR)  # supersedes attempt 1: its ids are aborted, FREE
    assert done.attempt is not None
    live = lease(c, gen, 1, done.attempt.number, 0, precommit=False)
    # aborted and freed, but in quarantine (its try may still be alive): the pool grows instead
    assert live.transactional_id not in {h.transactional_id for h in held}
    freed = held[1].transactional_id
    assert pool(c)[freed] is TransactionalIdState.FREE
    kafka.aborts.clear()
    kafka.open_transactions = [
        open_txn(live.transactional_id, 1),  # the attempt in flight: explained
        open_txn(freed, 2),  # a FREE id with an open transaction: a zombie producer re-opened it
        open_txn(f"{PREFIX}-77", 3),  # never in the pool (an old deployment's id)
        open_txn("views-eos-0", 4),  # another sink's prefix: that sink's sweep deals with it
    ]
    found_before, aborted_before = metric("coordinator_lingering_transactions_found_total"), metric(
        "coordinator_lingering_transactions_aborted_total")

    report = loop.run_once()
    r = report.sinks[NAME]

    assert sorted(r.lingering_found) == sorted([freed, f"{PREFIX}-77"])
    assert sorted(r.lingering_aborted) == sorted([freed, f"{PREFIX}-77"])
    assert sorted(t for s, t in kafka.aborts if s == NAME) == sorted([freed, f"{PREFIX}-77"])
    assert [t for s, t in kafka.aborts if s != NAME] == ["views-eos-0"]
    assert report.sinks["other"].lingering_aborted == ["views-eos-0"]
    assert {t.transactional_id for t in kafka.open_transactions} == {live.transactional_id}
    assert states(c)[live.id] is LeaseState.LEASED and in_flight.id in states(c)
    assert metric("coordinator_lingering_transactions_found_total") == found_before + 2
    assert metric("coordinator_lingering_transactions_aborted_total") == aborted_before + 2
    ks = kinds(c)
    assert ks.count("lingering_transactions_found") == 1 and ks.count("lingering_transaction_aborted") == 2
    assert f"{PREFIX}-77" not in pool(c)  # the sweep does not add ids to the pool
    assert_invariants(c, settled=False)


def test_sweep_never_races_a_lease_grant_of_the_same_id(
    coordinator: Coordinator, kafka: RecordingControlPlane, engine: Engine, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    x = lease(c, gen, 0, attempt, 0, precommit=False)
    c.abort_attempt(NAME, 0, attempt, gen, "driver gave up", ACTOR)
    assert pool(c)[x.transactional_id] is TransactionalIdState.FREE
    kafka.aborts.clear()
    kafka.open_transactions = [open_txn(x.transactional_id)]

    # a lease grant holds the FREE row locked (FOR UPDATE SKIP LOCKED) while it inserts its lease
    with engine.begin() as granting:
        granting.execute(select(transactional_ids).where(transactional_ids.c.transactional_id == x.transactional_id)
                         .with_for_update(skip_locked=True)).one()
        r = loop.run_once().sinks[NAME]
        assert r.lingering_found == [x.transactional_id] and r.lingering_aborted == []
        assert kafka.aborts == []  # never sent while a grant may be handing the id out
    # the grant ended without taking it: the next sweep aborts it
    r = loop.run_once().sinks[NAME]
    assert r.lingering_aborted == [x.transactional_id] and kafka.aborts == [(NAME, x.transactional_id)]


def test_sweep_of_an_id_outside_the_pool_waits_for_pool_growth(
    coordinator: Coordinator, kafka: RecordingControlPlane, engine: Engine, loop: RecoveryLoop
) -> None:
    c = coordinator
    start(c)
    sink = c.get_sink(NAME)
    kafka.open_transactions = [open_txn(f"{PREFIX}-0")]  # not in the pool yet: the next grant creates it
    with engine.begin() as growing:
        # a grant growing the pool holds the growth lock and inserts the id (not yet committed)
        growing.execute(text("SELECT pg_advisory_xact_lock(hashtext('coordinator.pool_growth'), hashtext(:s))"),
                        {"s": str(sink.id)})
        growing.execute(transactional_ids.insert().values(sink_id=sink.id, ordinal=0, transactional_id=f"{PREFIX}-0",
                                                          state="FREE"))
        out: list = []
        t = threading.Thread(target=lambda: out.append(loop.run_once()))
        t.start()
        time.sleep(0.5)
        assert t.is_alive() and kafka.aborts == []  # the sweep waits for the growth to commit
        growing.execute(transactional_ids.update().where(transactional_ids.c.ordinal == 0,
                                                         transactional_ids.c.sink_id == sink.id)
                        .values(state="LEASED"))
    t.join(10)
    assert not t.is_alive()
    r = out[0].sinks[NAME]
    assert r.lingering_found == [f"{PREFIX}-0"] and r.lingering_aborted == [] and kafka.aborts == []


# --- scale-down ------------------------------------------------------------------------------


def test_scale_down_aborts_every_id_of_the_higher_partitions_within_one_iteration(
    coordinator: Coordinator, kafka: RecordingControlPlane, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    first = begin(c, gen, 0)
    eight = [lease(c, gen, 0, first, p, precommit=p % 2 == 0) for p in range(8)]
    kafka.open_transactions = [open_txn(x.transactional_id, 100 + x.partition) for x in eight]
    # the driver restarts while Kafka is unreachable: the eight aborts stay pending
    kafka.fail_next(UNREACHABLE, times=8)
    gen2, fenced = c.start_generation(NAME, "query-1", "run-2", ACTOR)
    assert sorted(fenced.pending) == sorted(x.transactional_id for x in eight) and fenced.aborted == []
    kafka.clear_failures()  # the broker is back
    second = begin(c, gen2, 0)
    three = [lease(c, gen2, 0, second, p) for p in range(3)]  # fewer partitions now
    assert not {x.transactional_id for x in three} & {x.transactional_id for x in eight}  # I3
    kafka.open_transactions += [open_txn(x.transactional_id, 200 + x.partition) for x in three]

    r = loop.run_once().sinks[NAME]

    assert sorted(r.aborted) == sorted(x.transactional_id for x in eight)
    assert {t for _, t in kafka.aborts} == {x.transactional_id for x in eight}
    assert {t.transactional_id for t in kafka.open_transactions} == {x.transactional_id for x in three}
    assert r.lingering_found == []  # what was left open is the attempt in flight
    assert all(states(c)[x.id] is LeaseState.ABORTED for x in eight)
    result = c.commit(NAME, 0, second, gen2, [PR(x.partition, x.id) for x in three], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED and kafka.open_transactions == []
    assert_invariants(c)


# --- backoff and the thread ------------------------------------------------------------------


def test_a_failing_step_backs_off_alone(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock) -> None:
    now = [1000.0]
    loop = RecoveryLoop(coordinator, interval_ms=1_000, leader_ttl_ms=10_000, max_backoff_ms=8_000,
                        monotonic=lambda: now[0])
    try:
        c = coordinator
        gen = start(c)
        attempt = begin(c, gen, 0)
        dead = lease(c, gen, 0, attempt, 0, precommit=False)
        kafka.fail_next(UNREACHABLE)  # the sweep's ListTransactions (nothing else calls Kafka yet)
        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert set(r.errors) == {"sweep"}
        clock.advance(ms=TIMEOUT_MS)  # now the lease expires: that step still runs
        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert r.skipped == ["sweep"] and r.expired == [dead.transactional_id] and r.errors == {}
        now[0] += 2.1  # past the first backoff (2 x interval)
        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert r.skipped == [] and r.errors == {}
        for failures in range(1, 6):  # exponential, capped at max_backoff_ms
            kafka.fail_next(UNREACHABLE)
            now[0] += 100
            assert "sweep" in loop.run_once(honor_backoff=True).sinks[NAME].errors
            b = loop._backoff[(NAME, "sweep")]
            assert b.failures == failures
            assert b.until - now[0] <= min(1.0 * 2 ** failures, 8.0) + 1e-6
            assert b.until - now[0] >= 0.8 * min(1.0 * 2 ** failures, 8.0) - 1e-6
    finally:
        loop.stop()


def test_the_thread_finishes_a_decided_commit_and_releases_leadership_on_stop(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    w = lease(c, gen, 0, attempt, 0)
    kafka.fail_next(UNREACHABLE)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, [PR(0, w.id)], ACTOR)
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=2_000, holder="thread").start()
    try:
        deadline = time.monotonic() + 10
        while c.snapshot().checkpoints[0].state is not CheckpointState.COMMITTED:
            assert time.monotonic() < deadline, "the loop did not finish the commit"
            time.sleep(0.05)
        assert loop.is_leader and REGISTRY.get_sample_value("coordinator_recovery_leader") == 1
    finally:
        loop.stop()
    row = loop.lease.current()
    assert row is not None and row["holder"] == "thread" and row["live"] is False
    assert REGISTRY.get_sample_value("coordinator_recovery_leader") == 0


def test_idle_sinks_cost_the_loop_one_query_whatever_their_number(engine: Engine, clock: ManualClock) -> None:
    """Each iteration asks the database once which sinks may have work; an idle sink costs no
    statement of its own (it cost ~10 in 5 transactions before). A sink whose lease reaches the
    commit margin exactly is still found and aborted (the idle check is not narrower than the rule)."""
    c = Coordinator(engine, None, clock=clock, limits=Limits(max_partitions=16))
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000)
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        statements.append(statement)

    try:
        for i in range(8):
            start(c, f"idle-{i}", f"idle-{i}-eos")
        gen = start(c)
        attempt = begin(c, gen, 0)
        dead = lease(c, gen, 0, attempt, 0, precommit=False)
        event.listen(engine, "before_cursor_execute", count)
        try:
            idle = loop.run_once()
            assert len(statements) <= 2, statements  # the leadership renewal and the idle check
            assert set(idle.sinks) == {NAME, *(f"idle-{i}" for i in range(8))}
            assert all(r.expired == [] and r.errors == {} for r in idle.sinks.values())
            # the lease's deadline now exactly the commit margin away: the commit gate refuses it
            clock.advance(ms=int((dead.deadline_at - clock.now()).total_seconds() * 1000) - MARGIN_MS + 1)
            r = loop.run_once().sinks[NAME]
        finally:
            event.remove(engine, "before_cursor_execute", count)
        assert r.expired == [dead.transactional_id] and r.errors == {}
        assert states(c)[dead.id] is LeaseState.ABORTING
    finally:
        loop.stop()
        c.close()


def test_the_leadership_is_renewed_before_a_busy_sink_only_once_a_quarter_ttl_has_passed(
    engine: Engine, clock: ManualClock
) -> None:
    """With a control plane every sink has work (its sweep). The leader renews at the start of the
    iteration, then before a sink only once a quarter of the TTL has passed since: not once per
    sink. A renewal that finds the lease taken over stops the iteration at once."""
    c = Coordinator(engine, RecordingControlPlane(), clock=clock, limits=Limits(max_partitions=16))
    now = [0.0]
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000, monotonic=lambda: now[0])
    renewals: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if "recovery_leader" in statement:
            renewals.append(statement)

    names = [f"busy-{i}" for i in range(6)]
    try:
        for name in names:
            start(c, name, f"{name}-eos")
        event.listen(engine, "before_cursor_execute", count)
        try:
            r = loop.run_once()
            assert r.leader and not r.lost_leadership and set(names) <= set(r.sinks)
            assert len(renewals) == 1, renewals  # the iteration's own; no time passed before the sinks
            renewals.clear()

            def sweep_and_wait(name: str) -> object:  # each sink's sweep takes a quarter of the TTL
                now[0] += 2.5
                return original(name)

            original = c.sweep_lingering
            c.sweep_lingering = sweep_and_wait  # type: ignore[method-assign]
            r = loop.run_once()
            assert not r.lost_leadership and set(names) <= set(r.sinks)
            assert len(renewals) == len(r.sinks), renewals  # the iteration's, then before every sink but the first

            taken: list[int | None] = []

            def sweep_while_taken_over(name: str) -> object:  # the lease lapses and another replica takes it
                if not taken:
                    with engine.begin() as conn:
                        conn.execute(text("UPDATE recovery_leader SET expires_at = now() - interval '1 millisecond'"))
                    taken.append(LeaderLease(engine, "other", 10_000).acquire())
                now[0] += 2.5
                return original(name)

            c.sweep_lingering = sweep_while_taken_over  # type: ignore[method-assign]
            r = loop.run_once()
            assert taken[0] is not None
            assert r.lost_leadership and len(r.sinks) == 1  # the next sink's renewal found it lost: no more work
        finally:
            event.remove(engine, "before_cursor_execute", count)
    finally:
        loop.stop()
        c.close()


def test_no_control_plane_leaves_kafka_work_pending(engine: Engine, clock: ManualClock) -> None:
    c = Coordinator(engine, None, clock=clock, limits=Limits(max_partitions=16))
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=1_000)
    try:
        gen = start(c)
        attempt = begin(c, gen, 0)
        dead = lease(c, gen, 0, attempt, 0, precommit=False)
        clock.advance(ms=TIMEOUT_MS)
        r = loop.run_once().sinks[NAME]
        assert r.expired == [dead.transactional_id] and r.abort_pending == [dead.transactional_id]
        assert "sweep" in r.skipped and r.errors == {}
        assert states(c)[dead.id] is LeaseState.ABORTING
    finally:
        loop.stop()
        c.close()


# --- the pure decisions ----------------------------------------------------------------------


def test_recovery_rules_decide_from_plain_records(coordinator: Coordinator, clock: ManualClock) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    a, b = lease(c, gen, 0, attempt, 0), lease(c, gen, 0, attempt, 1, precommit=False)
    snap = c.snapshot()
    now = clock.now()
    assert recovery_rules.expired_leases(snap.leases, snap.attempts, now, MARGIN_MS) == []
    assert recovery_rules.expired_leases(snap.leases, snap.attempts, now + timedelta(milliseconds=TIMEOUT_MS - MARGIN_MS),
                                         MARGIN_MS) == []
    later = now + timedelta(milliseconds=TIMEOUT_MS - MARGIN_MS + 1)
    assert [x.id for x in recovery_rules.expired_leases(snap.leases, snap.attempts, later, MARGIN_MS)] == [a.id, b.id]
    decided = [replace(x, state=AttemptState.COMMITTING) for x in snap.attempts]
    assert recovery_rules.expired_leases(snap.leases, decided, later, MARGIN_MS) == []
    assert [x.id for x in recovery_rules.near_timeout(snap.leases, now + timedelta(seconds=48), TIMEOUT_MS)] == [a.id]
    txns = [open_txn(a.transactional_id), open_txn("x-1"), open_txn("x-1")]
    assert [t.transactional_id for t in recovery_rules.lingering(txns, snap.leases)] == ["x-1"]
    resolved = [replace(x, state=LeaseState.ABORTED) for x in snap.leases]
    assert [t.transactional_id for t in recovery_rules.lingering(txns, resolved)] == [a.transactional_id, "x-1"]
    cps = [replace(snap.checkpoints[0], state=s) for s in (CheckpointState.COMMITTING,)]
    assert recovery_rules.checkpoints_to_finish(cps, []) == [cps[0].id]
    lost = replace(snap.checkpoints[0], state=CheckpointState.LOST)
    assert recovery_rules.checkpoints_to_finish([lost], []) == []
    assert recovery_rules.checkpoints_to_finish([lost], [replace(a, state=LeaseState.COMMITTING)]) == [lost.id]
