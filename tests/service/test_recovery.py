"""The recovery loop (DESIGN.md §3 step 6) on a real Postgres with the record-only Kafka control
plane (its `open_transactions` stands in for the broker's KIP-664 answers) and a manual clock:
leader election by lease row and fencing token, finishing decided commits without the driver,
aborting expired leases and lingering transactions (never racing a lease grant), warnings at
80 % of a transaction's lifetime, scale-down, per-step backoff, and a pass whose cost follows
what is due. What a real broker does to the loop is tests/service/test_recovery_starvation.py's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, event

from coordinator.kafka.control_plane import ControlPlaneError, OpenTransaction, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.configuration import CommitReach
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import Lease, PrecommitRecord
from coordinator.protocol.model import PartitionResult as PR
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.service.clock import ManualClock
from coordinator.service.recovery import LeaderLease, RecoveryLoop
from coordinator.service.recovery_steps import NAMED_IN_LOG

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


def begin(c: Coordinator, gen: int, batch: int, name: str = NAME, partitions: int | None = None) -> int:
    r = c.begin_checkpoint(name, batch, gen, ACTOR, partitions=partitions)
    assert r.action is BeginAction.NEW_ATTEMPT and r.attempt is not None
    return r.attempt.number


def lease(c: Coordinator, gen: int, batch: int, attempt: int, partition: int, *, name: str = NAME,
          task: int | None = None) -> Lease:
    return c.begin_partition(name, batch, attempt, gen, partition, 1000 * attempt + partition if task is None else task)


def won(x: Lease) -> PR:
    """The lease as its partition's winner, with the record its try reported."""
    assert x.task_attempt_id is not None
    return PR(x.partition, x.id, PrecommitRecord(x.task_attempt_id, 9000 + x.id, 0, 5, 500))


def open_txn(tid: str, producer_id: int = 1) -> OpenTransaction:
    return OpenTransaction(tid, producer_id, 0, "Ongoing", None, TIMEOUT_MS, (("out", 0),))


def states(c: Coordinator) -> dict[int, LeaseState]:
    return {x.id: x.state for x in c.snapshot().leases}


def held(c: Coordinator) -> set[str]:
    """The ids an unresolved lease holds."""
    return {x.transactional_id for x in c.snapshot().leases if x.resolved_at is None}


def quarantined(c: Coordinator) -> set[int]:
    return {q.ordinal for q in c.snapshot().quarantines if q.until > c.clock.now()}


def kinds(c: Coordinator, name: str = NAME) -> list[str]:
    return [ev["kind"] for ev in c.list_events(name, limit=1000)]


def decided_on_a_silent_broker(c: Coordinator, kafka: RecordingControlPlane, gen: int, batch: int) -> list[Lease]:
    """A two-partition batch whose first tries claimed their pre-leases, its commit decided while
    the broker answers nothing (it stays so until kafka.clear_failures()): COMMITTING."""
    attempt = begin(c, gen, batch, partitions=2)
    firsts = [lease(c, gen, batch, attempt, p) for p in range(2)]
    kafka.fail_next(UNREACHABLE, times=1000)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, batch, attempt, gen, [won(x) for x in firsts], ACTOR)
    return firsts


def assert_invariants(c: Coordinator, *, settled: bool = True) -> None:
    violations = check_invariants(c.snapshot(), settled=settled)
    assert violations == [], [str(v) for v in violations]


@pytest.fixture
def loop(coordinator: Coordinator) -> Iterator[RecoveryLoop]:
    """A loop that never sweeps: its steps' Kafka calls are the only ones (a failure a test queues
    on the record-only plane is theirs)."""
    r = RecoveryLoop(coordinator, interval_ms=50, leader_ttl_ms=10_000, holder="replica-a", sweep_interval_ms=None)
    yield r
    r.stop()


@pytest.fixture
def sweeping(coordinator: Coordinator) -> Iterator[RecoveryLoop]:
    """A loop that sweeps every cluster at every pass."""
    r = RecoveryLoop(coordinator, interval_ms=50, leader_ttl_ms=10_000, holder="replica-s", sweep_interval_ms=0)
    yield r
    r.stop()


# --- leader election -------------------------------------------------------------------------


def test_one_leader_among_two_and_the_other_takes_over_when_it_stops_renewing(
    engine: Engine, kafka: RecordingControlPlane
) -> None:
    # each replica has its own coordinator (and clocks far apart: leadership uses the database's)
    a_coord = Coordinator(engine, kafka, clock=ManualClock())
    b_coord = Coordinator(engine, kafka, clock=ManualClock(ManualClock().now() + timedelta(days=3)))
    # a TTL well beyond a stall of this shared machine, so only a's stopping hands it over
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


def test_leader_lease_is_exclusive_under_concurrent_acquires(coordinator: Coordinator) -> None:
    leases = [LeaderLease(coordinator, f"replica-{i}", 5_000) for i in range(8)]
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
    loser = lease(c, gen, 0, attempt, 1, task=99)  # a speculative copy that lost
    kafka.fail_next(UNREACHABLE, times=3)  # both commits and the loser's abort fail: the driver gives up
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, [won(w0), won(w1)], ACTOR)
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
    assert held(c) == set()
    # the trail says recovery finished it: the batch's decision, then the recovery's committed mark
    trail = [(ev["kind"], ev["actor"]) for ev in c.list_events(NAME, batch_id=0, limit=1000)]
    assert [x for x in trail if x[0] in ("commit_decided", "checkpoint_committed")] == [
        ("commit_decided", ACTOR), ("checkpoint_committed", "recovery")]
    (done,) = [ev for ev in c.list_events(NAME, batch_id=0, limit=1000) if ev["kind"] == "checkpoint_committed"]
    assert done["detail"] == {"batch_id": 0, "attempt": attempt, "by": "recovery_loop"}
    assert_invariants(c)
    # nothing left: the next iteration does nothing
    calls = (len(kafka.commits), len(kafka.aborts))
    assert loop.run_once().sinks.get(NAME) is None or loop.run_once().sinks[NAME].committed == []
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
        c.commit(NAME, 0, attempt, gen, [won(w0)], ACTOR)
    grace_ms = 5_000
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000, holder="replica-g", finish_grace_ms=grace_ms)
    try:
        sent = len(kafka.commits)
        clock.advance(ms=grace_ms - 1)
        due, names, _ = loop._due()
        assert {names[k]: v for k, v in due.steps.items()}.get(NAME, set()) == set()
        assert c.finish_decided_commits(NAME, grace_ms).committed == []
        r = loop.run_once().sinks.get(NAME)
        assert (r is None or (r.committed == [] and r.errors == {})) and len(kafka.commits) == sent
        assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING

        clock.advance(ms=1)
        due, names, _ = loop._due()
        assert {names[k]: {s.value for s in v} for k, v in due.steps.items()}[NAME] == {"finish"}
        r = loop.run_once().sinks[NAME]
        assert r.committed == [0] and len(kafka.commits) == sent + 1
        assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTED
        assert_invariants(c)
    finally:
        loop.stop()


def test_the_commit_reach_counts_every_finishers_window_from_the_decision() -> None:
    """The loop starts on an orphaned decision at most its grace plus an interval after it (or, if
    the decider also led the loop, a failover plus an interval); every finisher stops retrying at
    the window's end, counted from the decision, and its last request lands within a request
    timeout: no later than the reach every commit margin exceeds."""
    for reach in (CommitReach(request_timeout_ms=4_000, retry_budget_ms=8_000, leader_ttl_ms=6_000,
                              recovery_interval_ms=2_000),
                  CommitReach(request_timeout_ms=4_000, retry_budget_ms=8_000, leader_ttl_ms=1_000,
                              recovery_interval_ms=200)):  # a short TTL: the loop's grace is the later
        first_pass = max(reach.recovery_grace_ms, reach.leader_ttl_ms + reach.recovery_interval_ms) \
            + reach.recovery_interval_ms
        assert first_pass <= reach.retry_window_ms  # the loop looks at it inside the window
        # a failed-over loop still gets a whole retry budget inside the window
        assert reach.leader_ttl_ms + 2 * reach.recovery_interval_ms + reach.retry_budget_ms <= reach.retry_window_ms
        deciders_last = reach.retry_budget_ms + reach.request_timeout_ms
        assert max(deciders_last, reach.retry_window_ms + reach.request_timeout_ms) <= reach.total_ms
    default = CommitReach(4_000, 8_000, 6_000, 2_000)
    assert (default.recovery_grace_ms, default.retry_window_ms, default.total_ms) == (12_000, 18_000, 22_000)


def test_a_late_finisher_retries_once_the_window_is_over(coordinator: Coordinator, clock: ManualClock) -> None:
    """A finisher's retry budget is what is left of the decision's window, at least one request."""
    c = Coordinator(coordinator.engine, RecordingControlPlane(), clock=clock, limits=Limits(
        commit_reach=CommitReach(request_timeout_ms=4_000, retry_budget_ms=8_000, leader_ttl_ms=6_000,
                                 recovery_interval_ms=2_000)))
    decided = clock.now()
    assert c.ctx.commit_budget_ms(decided, decided) == 8_000  # the deciding call: its whole budget
    assert c.ctx.commit_budget_ms(decided, decided + timedelta(seconds=13)) == 5_000  # the loop after its grace
    assert c.ctx.commit_budget_ms(decided, decided + timedelta(seconds=60)) == 4_000  # past the window: one try


def test_run_once_reports_a_commit_refused_for_good_as_lost(
    coordinator: Coordinator, kafka: RecordingControlPlane, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    w = lease(c, gen, 0, attempt, 0)
    kafka.fail_next(UNREACHABLE)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, [won(w)], ACTOR)
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
    assert all(r.errors == {} for r in loop.run_once().sinks.values())


def test_an_unexpected_broker_error_keeps_the_commit_decided_with_backoff_and_never_aborts_it(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    """UNKNOWN_SERVER_ERROR (or an authorization failure after an ACL change) is not a refusal that
    ends a transaction: the loop backs off and tries again; nothing is lost."""
    c = coordinator
    now = [0.0]
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000, holder="replica-a", monotonic=lambda: now[0],
                        sweep_interval_ms=None)
    try:
        gen = start(c)
        attempt = begin(c, gen, 0)
        w = lease(c, gen, 0, attempt, 0)
        odd = ControlPlaneError("EndTxn: broker answered UNKNOWN_SERVER_ERROR", retriable=False,
                                code="unknown_server_error")
        kafka.fail_next(odd, times=2)
        with pytest.raises(e.Unavailable):
            c.commit(NAME, 0, attempt, gen, [won(w)], ACTOR)

        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert r.lost == [] and r.committed == [] and 0 in r.commit_pending and "UNKNOWN_SERVER_ERROR" in r.errors["finish"]
        assert "finish" in loop.run_once(honor_backoff=True).sinks[NAME].skipped  # backing off
        assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING and not c.get_sink(NAME).halted
        assert kafka.aborts == [] and "data_lost" not in kinds(c)

        now[0] += 60  # the backoff is over, and the broker answers again
        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert r.committed == [0] and c.snapshot().checkpoints[0].state is CheckpointState.COMMITTED
        assert_invariants(c)
    finally:
        loop.stop()


# --- expired leases --------------------------------------------------------------------------


def test_run_once_aborts_leases_that_can_no_longer_pass_the_commit_gate(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0, partitions=4)
    dead_task = lease(c, gen, 0, attempt, 0)  # an executor died mid-write
    flushed = lease(c, gen, 0, attempt, 1)  # its record reached the driver, which never came to commit
    clock.advance(ms=TIMEOUT_MS - MARGIN_MS)
    assert loop.run_once().sinks[NAME].expired == []  # exactly the margin left: the gate still passes
    fresh = lease(c, gen, 0, attempt, 2)  # a task claiming its pre-lease late: its deadline starts now
    clock.advance(ms=1)
    expired_before = metric("coordinator_expired_leases_aborted_total")

    r = loop.run_once().sinks[NAME]

    assert sorted(r.expired) == sorted([dead_task.transactional_id, flushed.transactional_id])
    assert sorted(r.aborted) == sorted(r.expired)
    now = states(c)
    assert now[dead_task.id] is LeaseState.ABORTED and now[flushed.id] is LeaseState.ABORTED
    assert now[fresh.id] is LeaseState.LEASED
    (unclaimed,) = [x for x in c.snapshot().leases if x.partition == 3]
    assert unclaimed.state is LeaseState.ABORTED and unclaimed.transactional_id not in {t for _, t in kafka.aborts}
    assert {t for _, t in kafka.aborts} == {dead_task.transactional_id, flushed.transactional_id}
    assert dead_task.transactional_id not in held(c) and dead_task.ordinal in quarantined(c)  # freed after the abort
    assert fresh.transactional_id in held(c)
    assert "expired_leases_aborted" in kinds(c)
    assert metric("coordinator_expired_leases_aborted_total") == expired_before + 2
    assert c.snapshot().attempts[0].state is AttemptState.OPEN  # the attempt itself may still commit
    assert_invariants(c)

    # the driver naming the expired winner is refused as the timeout gate refuses it: replay
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, attempt, gen, [PR(0, None), won(flushed), PR(2, None), PR(3, None)], ACTOR)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE
    assert c.snapshot().attempts[0].state is AttemptState.ABORTED
    assert_invariants(c, settled=False)


def test_expired_lease_abort_waits_for_kafka(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    dead = lease(c, gen, 0, attempt, 0)
    clock.advance(ms=TIMEOUT_MS)
    kafka.fail_next(UNREACHABLE)

    r = loop.run_once().sinks[NAME]
    assert r.expired == [dead.transactional_id] and r.abort_pending == [dead.transactional_id]
    assert states(c)[dead.id] is LeaseState.ABORTING
    assert dead.transactional_id in held(c)  # not handed out meanwhile (I3)
    other = lease(c, gen, 0, attempt, 1)
    assert other.transactional_id != dead.transactional_id

    r = loop.run_once().sinks[NAME]  # Kafka is back: the pending abort is done
    assert r.aborted == [dead.transactional_id] and states(c)[dead.id] is LeaseState.ABORTED
    assert dead.transactional_id not in held(c)
    assert_invariants(c)


# --- warnings --------------------------------------------------------------------------------


def test_warns_once_at_80_percent_of_a_transactions_lifetime(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, loop: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0, partitions=2)
    w = lease(c, gen, 0, attempt, 0)
    clock.advance(ms=10_000)
    late = lease(c, gen, 0, attempt, 1)  # claimed 10 s later: its transaction is 10 s younger
    clock.advance(ms=int(TIMEOUT_MS * 0.8) - 10_001)
    assert loop.run_once().sinks.get(NAME) is None or loop.run_once().sinks[NAME].warned == []
    warnings_before = metric("coordinator_transaction_timeout_warnings_total")
    clock.advance(ms=1)

    r = loop.run_once().sinks[NAME]
    assert r.warned == [w.transactional_id] and r.near_timeout == [w.transactional_id]
    assert late.transactional_id not in r.near_timeout
    (ev,) = [x for x in c.list_events(NAME, limit=1000) if x["kind"] == "transaction_near_timeout"]
    assert ev["batch_id"] == 0 and ev["detail"]["count"] == 1 and ev["detail"]["fraction"] == 0.8
    assert ev["detail"]["leases"] == [[w.id, 0, w.transactional_id, "LEASED", 0.8, TIMEOUT_MS - int(TIMEOUT_MS * 0.8)]]
    assert metric("coordinator_transaction_timeout_warnings_total") == warnings_before + 1
    assert metric("coordinator_transactions_near_timeout") == 1

    clock.advance(ms=1_000)
    again = loop.run_once().sinks[NAME]  # still near its timeout, but warned once only
    assert again.warned == [] and again.near_timeout == [w.transactional_id]
    assert kinds(c).count("transaction_near_timeout") == 1
    # still outside the margin: the commit goes through
    result = c.commit(NAME, 0, attempt, gen, [won(w), won(late)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    loop.run_once()
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
                               f"{live[0].transactional_id} (lease {live[0].id}, LEASED), ")
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
    assert warnings[1]["detail"]["leases"][0][:4] == [late.id, 30, late.transactional_id, "LEASED"]


def test_every_step_of_the_loop_works_on_a_batchs_first_tries(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, sweeping: RecoveryLoop
) -> None:
    """The two-call protocol's common path: pre-leases claimed by first tries. The sweep finds their
    open transactions explained, an abandoned batch's are aborted once they can no longer pass the
    commit gate, a decided batch's are committed once Kafka answers, and no step fails on the way."""
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0, partitions=2)
    abandoned = [lease(c, gen, 0, attempt, p) for p in range(2)]
    kafka.open_transactions = [open_txn(x.transactional_id) for x in abandoned]  # the tasks are writing
    r = sweeping.run_once().sinks[NAME]
    assert r.errors == {} and r.lingering_found == [] and r.expired == []  # their leases explain them
    clock.advance(ms=TIMEOUT_MS - MARGIN_MS + 1)  # past the commit gate: the driver is gone
    r = sweeping.run_once().sinks[NAME]
    assert r.errors == {} and sorted(r.expired) == sorted(r.aborted) == sorted(x.transactional_id for x in abandoned)
    assert {x.id: states(c)[x.id] for x in abandoned} == {x.id: LeaseState.ABORTED for x in abandoned}

    kafka.open_transactions = []
    decided = decided_on_a_silent_broker(c, kafka, gen, 1)
    kafka.clear_failures()  # the broker is back
    r = sweeping.run_once().sinks[NAME]
    assert r.errors == {} and r.committed == [1]
    assert {states(c)[x.id] for x in decided} == {LeaseState.COMMITTED}
    assert_invariants(c)


# --- lingering transactions ------------------------------------------------------------------


def test_sweep_aborts_exactly_the_open_transactions_the_database_does_not_explain(
    coordinator: Coordinator, kafka: RecordingControlPlane, sweeping: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    c.register_sink(SinkSpec(name="other", transactional_id_prefix="views-eos", bootstrap_servers="kafka:9092",
                             topics=["v"]), ACTOR)
    attempt = begin(c, gen, 0)
    first = [lease(c, gen, 0, attempt, p) for p in range(2)]
    done = c.begin_checkpoint(NAME, 1, gen, ACTOR)  # supersedes attempt 1: its ids are aborted
    assert done.attempt is not None
    live = lease(c, gen, 1, done.attempt.number, 0)
    # aborted, but in quarantine (its try may still be alive): the pool hands out another id
    assert live.transactional_id not in {h.transactional_id for h in first}
    freed = first[1].transactional_id
    assert freed not in held(c) and first[1].ordinal in quarantined(c)
    kafka.aborts.clear()
    kafka.open_transactions = [
        open_txn(live.transactional_id, 1),  # the attempt in flight: explained
        open_txn(freed, 2),  # a freed id with an open transaction: a zombie producer re-opened it
        open_txn(f"{PREFIX}-77", 3),  # never in the pool (an old deployment's id)
        open_txn("views-eos-0", 4),  # another sink's prefix: its own sweep deals with it
    ]
    found_before, aborted_before = metric("coordinator_lingering_transactions_found_total"), metric(
        "coordinator_lingering_transactions_aborted_total")

    report = sweeping.run_once()
    r = report.sinks[NAME]

    assert sorted(r.lingering_found) == sorted([freed, f"{PREFIX}-77"])
    assert sorted(r.lingering_aborted) == sorted([freed, f"{PREFIX}-77"])
    assert sorted(t for s, t in kafka.aborts if s == NAME) == sorted([freed, f"{PREFIX}-77"])
    assert [t for s, t in kafka.aborts if s != NAME] == ["views-eos-0"]
    assert report.sinks["other"].lingering_aborted == ["views-eos-0"]
    assert {t.transactional_id for t in kafka.open_transactions} == {live.transactional_id}
    assert states(c)[live.id] is LeaseState.LEASED
    assert metric("coordinator_lingering_transactions_found_total") == found_before + 2
    assert metric("coordinator_lingering_transactions_aborted_total") == aborted_before + 2
    ks = kinds(c)
    assert ks.count("lingering_transactions_found") == 1 and ks.count("lingering_transaction_aborted") == 2
    assert 77 in quarantined(c)  # held out of the pool while its abort could still land
    assert_invariants(c, settled=False)


def test_sweep_never_races_a_lease_grant_of_the_same_id(
    coordinator: Coordinator, kafka: RecordingControlPlane, engine: Engine, sweeping: RecoveryLoop, clock: ManualClock
) -> None:
    """The sweep quarantines a lingering transaction's id under the pool's lock before aborting it,
    so no grant can take the id while the abort is on its way; an id a grant took meanwhile is
    explained by its lease and left alone."""
    c = coordinator
    gen = start(c)
    attempt = begin(c, gen, 0)
    x = lease(c, gen, 0, attempt, 0)
    c.abort_attempt(NAME, 0, attempt, gen, "driver gave up", ACTOR)
    clock.advance(ms=c.limits.transactional_id_quarantine_ms + 1)  # the id is free again
    assert x.transactional_id not in held(c) and not quarantined(c)
    kafka.aborts.clear()
    kafka.open_transactions = [open_txn(x.transactional_id)]

    original = c.sweep_open_transactions
    regranted: list[Lease] = []

    def grant_first(sink, open_now):  # type: ignore[no-untyped-def]
        # between the broker's listing and the sweep's hold, a grant takes the id
        regranted.append(lease(c, gen, 1, begin(c, gen, 1), 0))
        return original(sink, open_now)

    c.sweep_open_transactions = grant_first  # type: ignore[method-assign]
    r = sweeping.run_once().sinks[NAME]
    assert regranted[0].transactional_id == x.transactional_id  # the pool's cursor came round to it
    assert r.lingering_found == [] and r.lingering_aborted == [] and kafka.aborts == []  # its lease explains it


def test_the_sweeps_hold_keeps_grants_off_the_id_until_its_abort_can_no_longer_land(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock, sweeping: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    kafka.open_transactions = [open_txn(f"{PREFIX}-0")]  # not in the pool yet: a grant would take it first
    r = sweeping.run_once().sinks[NAME]
    assert r.lingering_aborted == [f"{PREFIX}-0"]
    x = lease(c, gen, 0, begin(c, gen, 0), 0)
    assert x.transactional_id != f"{PREFIX}-0"  # held out while the abort could still land
    clock.advance(ms=c.limits.transactional_id_quarantine_ms + 1)
    y = lease(c, gen, 0, 1, 1)
    assert y.transactional_id == f"{PREFIX}-0"


# --- scale-down ------------------------------------------------------------------------------


def test_scale_down_aborts_every_id_of_the_higher_partitions_within_one_iteration(
    coordinator: Coordinator, kafka: RecordingControlPlane, sweeping: RecoveryLoop
) -> None:
    c = coordinator
    gen = start(c)
    first = begin(c, gen, 0, partitions=8)
    eight = [lease(c, gen, 0, first, p) for p in range(8)]
    kafka.open_transactions = [open_txn(x.transactional_id, 100 + x.partition) for x in eight]
    # the driver restarts while Kafka is unreachable: the eight aborts stay pending
    kafka.fail_next(UNREACHABLE, times=8)
    gen2, fenced = c.start_generation(NAME, "query-1", "run-2", ACTOR)
    assert sorted(fenced.pending) == sorted(x.transactional_id for x in eight) and fenced.aborted == []
    kafka.clear_failures()  # the broker is back
    second = begin(c, gen2, 0, partitions=3)
    three = [lease(c, gen2, 0, second, p) for p in range(3)]  # fewer partitions now
    assert not {x.transactional_id for x in three} & {x.transactional_id for x in eight}  # I3
    kafka.open_transactions += [open_txn(x.transactional_id, 200 + x.partition) for x in three]

    r = sweeping.run_once().sinks[NAME]

    assert sorted(r.aborted) == sorted(x.transactional_id for x in eight)
    assert {t for _, t in kafka.aborts} == {x.transactional_id for x in eight}
    assert {t.transactional_id for t in kafka.open_transactions} == {x.transactional_id for x in three}
    assert r.lingering_found == []  # what was left open is the attempt in flight
    assert all(states(c)[x.id] is LeaseState.ABORTED for x in eight)
    result = c.commit(NAME, 0, second, gen2, [won(x) for x in three], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED and kafka.open_transactions == []
    assert_invariants(c)


# --- backoff and the thread ------------------------------------------------------------------


def test_a_failing_step_backs_off_alone(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock) -> None:
    now = [1000.0]
    loop = RecoveryLoop(coordinator, interval_ms=1_000, leader_ttl_ms=10_000, max_backoff_ms=8_000,
                        monotonic=lambda: now[0], sweep_interval_ms=0)
    try:
        c = coordinator
        gen = start(c)
        attempt = begin(c, gen, 0)
        dead = lease(c, gen, 0, attempt, 0)
        kafka.fail_next(UNREACHABLE)  # the sweep's ListTransactions (nothing else calls Kafka yet)
        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert set(r.errors) == {"sweep"}
        clock.advance(ms=TIMEOUT_MS)  # now the lease expires: that step still runs
        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert "sweep" not in r.errors and r.expired == [dead.transactional_id] and r.errors == {}
        assert loop._backing_off("kafka:9092", "sweep")  # the sweep was skipped: backing off
        now[0] += 2.1  # past the first backoff (2 x interval)
        r = loop.run_once(honor_backoff=True).sinks[NAME]
        assert r.errors == {} and not loop._backing_off("kafka:9092", "sweep")
        for failures in range(1, 6):  # exponential, capped at max_backoff_ms
            kafka.fail_next(UNREACHABLE)
            now[0] += 100
            assert "sweep" in loop.run_once(honor_backoff=True).sinks[NAME].errors
            b = loop._backoff[("kafka:9092", "sweep")]
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
        c.commit(NAME, 0, attempt, gen, [won(w)], ACTOR)
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


def test_a_pass_costs_the_same_statements_whatever_the_number_of_idle_sinks(engine: Engine, clock: ManualClock) -> None:
    """A pass reads what is due (decided commits, unresolved leases) in a fixed number of statements;
    an idle sink costs none. A lease whose deadline reaches the commit margin exactly is still found
    and aborted (what is due is decided by the rule itself, not by a narrower filter)."""
    c = Coordinator(engine, None, clock=clock, limits=Limits(max_partitions=16))
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000)
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        statements.append(statement)

    def one_pass() -> list[str]:
        statements.clear()
        event.listen(engine, "before_cursor_execute", count)
        try:
            loop.run_once()
        finally:
            event.remove(engine, "before_cursor_execute", count)
        return list(statements)

    try:
        gen = start(c)
        one_pass()  # the first pass creates the leadership's row
        alone = len(one_pass())
        assert alone <= 3  # the leadership, the decided commits, the unresolved leases
        for i in range(40):
            start(c, f"idle-{i}", f"idle-{i}-eos")
        assert len(one_pass()) == alone  # forty idle sinks more: not one statement more
        attempt = begin(c, gen, 0)
        dead = lease(c, gen, 0, attempt, 0)
        # the lease's deadline now exactly one ms inside the commit margin: the commit gate refuses it
        clock.advance(ms=int((dead.deadline_at - clock.now()).total_seconds() * 1000) - MARGIN_MS + 1)
        r = loop.run_once().sinks[NAME]
        assert r.expired == [dead.transactional_id] and r.errors == {}
        assert states(c)[dead.id] is LeaseState.ABORTING
        assert set(loop.run_once().sinks) == {NAME}  # only the sink with work has a report
    finally:
        loop.stop()
        c.close()


def test_a_sinks_decided_commits_are_never_behind_another_sinks_slow_kafka_calls(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    """Each sink's decided commits run on a worker of their own: while one sink's Kafka calls hang,
    another's commit finishes in the same pass (with one shared worker, as a loop that walks the sinks
    in turn does, it waits behind them: the broken variant)."""
    c = coordinator
    release, hanging = threading.Event(), threading.Event()

    class Hanging(RecordingControlPlane):
        def commit_all(self, target, txns, parallelism, budget_ms=None):  # type: ignore[no-untyped-def]
            if hanging.is_set() and target.sink_name.startswith("a-dead"):
                release.wait(30)  # a cluster that does not answer
            return super().commit_all(target, txns, parallelism, budget_ms)

    plane = Hanging()
    slow = Coordinator(c.engine, plane, clock=c.clock, limits=c.limits)
    names = ("a-dead-1", "a-dead-2", "z-live")
    gens = {name: start(slow, name, f"{name}-eos") for name in names}

    def decided_without_its_decider(batch: int) -> None:
        for name in names:
            attempt = begin(slow, gens[name], batch, name=name)
            x = lease(slow, gens[name], batch, attempt, 0, name=name)
            plane.fail_next(UNREACHABLE)  # the deciding call's EndTxn: no answer, the decision stands
            with pytest.raises(e.Unavailable):
                slow.commit(name, batch, attempt, gens[name], [won(x)], ACTOR)

    def live_committed(batch: int) -> bool:
        live = slow.get_sink("z-live").id
        return any(cp.sink_id == live and cp.batch_id == batch and cp.state is CheckpointState.COMMITTED
                   for cp in slow.snapshot().checkpoints)

    for batch, finish_workers, expect in ((0, 64, True), (1, 1, False)):
        decided_without_its_decider(batch)
        hanging.set()
        loop = RecoveryLoop(slow, interval_ms=50, leader_ttl_ms=10_000, finish_workers=finish_workers,
                            sweep_interval_ms=None)
        try:
            loop.run_once(wait=False)
            deadline = time.monotonic() + 3
            while not live_committed(batch) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert live_committed(batch) is expect
        finally:
            hanging.clear()
            release.set()  # the dead clusters answer: the pass ends
            loop.stop()
            release.clear()


def test_no_control_plane_leaves_kafka_work_pending(engine: Engine, clock: ManualClock) -> None:
    c = Coordinator(engine, None, clock=clock, limits=Limits(max_partitions=16))
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=1_000)
    try:
        gen = start(c)
        attempt = begin(c, gen, 0)
        dead = lease(c, gen, 0, attempt, 0)
        clock.advance(ms=TIMEOUT_MS)
        r = loop.run_once().sinks[NAME]
        assert r.expired == [dead.transactional_id] and r.abort_pending == [dead.transactional_id]
        assert r.errors == {}
        assert states(c)[dead.id] is LeaseState.ABORTING
    finally:
        loop.stop()
        c.close()
