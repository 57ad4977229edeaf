"""Commit and resume through `Coordinator` on a real Postgres (a fresh migrated database per test)
with the record-only Kafka control plane and a manual clock: the happy path's every transition,
a decision left COMMITTING by Kafka and finished later (by a new generation's begin, a retry,
resume, a later batch), the timeout gate (I4), the commit's refusals, Kafka passes, and no
decision without a control plane (Kafka passes: test_kafka_passes.py).

Every scenario ends with the invariant checker over the whole durable state; every refused call
is checked to leave that state, the pool, the audit trail and Kafka untouched (I5)."""

from __future__ import annotations

import pytest
from coordinator.http.schemas import CommitOut
from coordinator.kafka.control_plane import (
    ControlPlaneError,
    PreparedTransaction,
    RecordingControlPlane,
)
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_committed_unchanged
from coordinator.protocol.model import Lease
from coordinator.protocol.model import PartitionResult as PR
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import (  # noqa: F401 - fixtures
    ACTOR,
    MARGIN_MS,
    NAME,
    PREFIX,
    TIMEOUT_MS,
    assert_invariants,
    claimed,
    committed_events,
    counts,
    empty,
    event_kinds,
    held,
    ids_of,
    invariants_hold_at_the_end,
    kafka_calls,
    lease_state,
    offline,
    quarantined,
    record,
    refused,
    spec,
    start,
    won,
)


# --- the happy path --------------------------------------------------------------------------


def test_happy_path_every_transition(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    sink, created = c.register_sink(spec(), ACTOR)
    assert created and sink.commit_margin_ms == MARGIN_MS and sink.transaction_timeout_ms == TIMEOUT_MS
    gen, _ = c.start_generation(NAME, "q1", "r1", ACTOR)

    begun = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3, offsets_digest="sha256:b0")
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.must_write and begun.pre_leased == 3
    assert begun.checkpoint.state is CheckpointState.OPEN and begun.attempt.number == 1
    taken_at = clock.now()
    assert held(c) == [f"{PREFIX}-{i}" for i in range(3)]  # each partition's id is held from begin (I3)

    clock.advance(ms=100)
    p0 = c.lease(NAME, 0, 1, gen, 0, 10)  # partition 0's first try claims its pre-lease
    p1 = c.lease(NAME, 0, 1, gen, 1, 11).lease
    p1_spec = c.lease(NAME, 0, 1, gen, 1, 12).lease  # a speculative copy of partition 1: its own id
    assert p0.attempt == 1 and p0.age_ms == 0 and p0.transaction_timeout_ms == TIMEOUT_MS
    assert p0.rules == begun.lease_rules and p0.rules.commit_margin_ms == MARGIN_MS
    p0 = p0.lease
    for x, ordinal, task in ((p0, 0, 10), (p1, 1, 11), (p1_spec, 3, 12)):
        assert x.state is LeaseState.LEASED and x.task_attempt_id == task
        assert x.transactional_id == f"{PREFIX}-{ordinal}" and x.ordinal == ordinal
        assert x.leased_at == clock.now()
        assert (x.deadline_at - x.leased_at).total_seconds() * 1000 == TIMEOUT_MS
    assert p0.taken_at == p1.taken_at == taken_at and p1_spec.taken_at == clock.now()
    assert held(c) == sorted(ids_of([p0, p1, p1_spec]) + [f"{PREFIX}-2"])
    assert_invariants(c)

    clock.advance(ms=1000)
    result = c.commit(NAME, 0, 1, gen, [won(p0, epoch=3), won(p1, epoch=3), empty(2)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED and result.checkpoint.committed_attempt == 1
    assert result.checkpoint.decided_at == clock.now() and result.checkpoint.committed_at == clock.now()
    assert result.attempt.state is AttemptState.COMMITTED and result.attempt.partitions == 3
    assert sorted((w.partition, w.id) for w in result.winners) == [(0, p0.id), (1, p1.id)]
    assert all(w.state is LeaseState.COMMITTED for w in result.winners)
    # the records that came with the commit are stored with the winners
    assert [(w.producer_id, w.producer_epoch, w.records, w.bytes) for w in result.winners] == [
        (1000 + p0.id, 3, 10, 1000), (1000 + p1.id, 3, 10, 1000)]
    # winners committed by resume with those producer ids and epochs
    assert sorted(kafka.commits, key=lambda t: t[1].transactional_id) == [
        (NAME, PreparedTransaction(p0.transactional_id, 1000 + p0.id, 3)),
        (NAME, PreparedTransaction(p1.transactional_id, 1000 + p1.id, 3)),
    ]
    # the speculative loser aborted, its id quarantined (its try may still be alive); the empty
    # partition's pre-lease freed at once without Kafka; the winners' ids free at once
    assert kafka.aborts == [(NAME, p1_spec.transactional_id)]
    assert result.aborts.aborted == [p1_spec.transactional_id] and result.aborts.pending == []
    assert lease_state(c, p1_spec.id) is LeaseState.ABORTED
    assert quarantined(c) == {p1_spec.ordinal}
    assert held(c) == []
    # one event per batch: its decision (the attempt and checkpoint rows record begin and commit)
    kinds = event_kinds(c)
    for kind in ("sink_registered", "generation_started", "commit_decided", "transactions_aborted"):
        assert kind in kinds
    assert [ev["kind"] for ev in c.list_events(NAME, batch_id=0, limit=1000)] == ["commit_decided"]
    (decided,) = [ev for ev in c.list_events(NAME, limit=1000) if ev["kind"] == "commit_decided"]
    assert decided["actor"] == ACTOR and decided["detail"]["winners"] == [[0, p0.id], [1, p1.id]]
    assert_invariants(c, settled=True)

    # Spark replays batch 0 (crash after the commit, before its commit log): skip
    committed = c.snapshot()
    rows, calls = counts(c.engine), kafka_calls(kafka)
    replay = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3, offsets_digest="sha256:b0")
    assert replay.action is BeginAction.SKIP and not replay.must_write and replay.pre_leased == 0
    assert replay.checkpoint == result.checkpoint and replay.attempt == result.attempt
    assert counts(c.engine) == rows and kafka_calls(kafka) == calls
    # ... also from a restarted driver (a new generation)
    gen2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    replay2 = c.begin_checkpoint(NAME, 0, gen2, ACTOR)
    assert replay2.action is BeginAction.SKIP and replay2.checkpoint.state is CheckpointState.COMMITTED
    assert check_committed_unchanged(committed, c.snapshot()) == []

    # the next batch reuses the pool: round-robin from where it stopped, the quarantined id skipped
    assert c.begin_checkpoint(NAME, 1, gen2, ACTOR, partitions=2).attempt.number == 1
    nxt = claimed(c, 1, 1, gen2, 2)
    assert [x.transactional_id for x in nxt] == [f"{PREFIX}-0", f"{PREFIX}-1"]
    c.commit(NAME, 1, 1, gen2, [won(x) for x in nxt], ACTOR)
    assert check_committed_unchanged(committed, c.snapshot()) == []
    assert [cp.batch_id for cp in c.list_checkpoints(NAME, state=CheckpointState.COMMITTED)] == [1, 0]
    assert_invariants(c, settled=True)


# --- a commit left COMMITTING by Kafka -------------------------------------------------------


def _decided_but_unfinished(c: Coordinator, kafka: RecordingControlPlane) -> tuple[int, Lease, Lease]:
    """Batch 0's commit is decided, but Kafka is unreachable: neither the winner's commit nor the
    loser's abort gets through."""
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    winner = c.begin_partition(NAME, 0, 1, gen, 0, 1)
    loser = c.begin_partition(NAME, 0, 1, gen, 0, 2)
    kafka.fail_next(ControlPlaneError("broker unreachable", retriable=True), times=2)
    with pytest.raises(e.Unavailable) as exc:
        c.commit(NAME, 0, 1, gen, [won(winner)], ACTOR)
    assert exc.value.reason == "kafka_commit_failed"
    assert winner.transactional_id in exc.value.detail["failures"]
    assert kafka.commits == [] and kafka.aborts == []
    return gen, winner, loser


def test_kafka_failure_leaves_committing_and_a_new_generation_resumes(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    gen, winner, loser = _decided_but_unfinished(c, kafka)
    d = c.checkpoint_detail(NAME, 0)
    assert d.checkpoint.state is CheckpointState.COMMITTING and d.checkpoint.committed_attempt == 1
    assert d.attempts[0].state is AttemptState.COMMITTING
    assert lease_state(c, winner.id) is LeaseState.COMMITTING
    assert lease_state(c, loser.id) is LeaseState.ABORTING
    assert held(c) == ids_of([winner, loser])  # both ids may still hold a transaction
    assert "commit_failed" in event_kinds(c) and "abort_failed" in event_kinds(c)
    assert_invariants(c)

    # the decision stands across a driver restart: the new generation does not abort it
    gen2, aborts = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert gen2 == gen + 1
    assert winner.transactional_id not in aborts.aborted + aborts.pending
    assert lease_state(c, winner.id) is LeaseState.COMMITTING
    # the old driver is fenced, even for its decided batch
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [won(winner)], ACTOR), e.STALE_GENERATION)

    begun = c.begin_checkpoint(NAME, 0, gen2, ACTOR)
    assert begun.action is BeginAction.RESUME and not begun.must_write
    assert begun.checkpoint.state is CheckpointState.COMMITTED
    assert begun.attempt is not None and begun.attempt.number == 1 and begun.attempt.state is AttemptState.COMMITTED
    assert kafka.commits == [(NAME, PreparedTransaction(winner.transactional_id, 1000 + winner.id, 0))]
    # finishing the decided commit also ends the loser's transaction, which would otherwise block
    # read_committed consumers of its partitions
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    assert held(c) == []
    # finished after its commit call: an event says who finished it (the decision's call wrote none)
    assert committed_events(c, 0) == [("recovery", {"batch_id": 0, "attempt": 1, "by": "begin"})]
    assert_invariants(c, settled=True)

    # resume answers from the record, with no second effect
    calls = kafka_calls(kafka)
    resumed = c.resume(NAME, 0)
    assert resumed.checkpoint == begun.checkpoint and resumed.attempt == begun.attempt
    assert [w.id for w in resumed.winners] == [winner.id] and resumed.winners[0].state is LeaseState.COMMITTED
    assert kafka_calls(kafka) == calls
    assert c.begin_checkpoint(NAME, 0, gen2, ACTOR).action is BeginAction.SKIP
    assert len(committed_events(c, 0)) == 1
    assert_invariants(c, settled=True)


def test_kafka_failure_then_the_same_driver_retries_commit(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen, winner, loser = _decided_but_unfinished(c, kafka)
    # a retry naming other winners, or the same winner with another record, is refused; the decision stands
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [won(loser)], ACTOR), e.WINNER_MISMATCH)
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [won(winner, epoch=1)], ACTOR), e.WINNER_MISMATCH)
    # Kafka still down: still COMMITTING
    kafka.fail_next(ControlPlaneError("still down", retriable=True))
    with pytest.raises(e.Unavailable) as exc:
        c.commit(NAME, 0, 1, gen, [won(winner)], ACTOR)
    assert exc.value.reason == "kafka_commit_failed"
    assert c.checkpoint_detail(NAME, 0).checkpoint.state is CheckpointState.COMMITTING
    result = c.commit(NAME, 0, 1, gen, [won(winner)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert committed_events(c, 0) == [("recovery", {"batch_id": 0, "attempt": 1, "by": "commit_retry"})]
    assert kafka.commits == [(NAME, PreparedTransaction(winner.transactional_id, 1000 + winner.id, 0))]
    # the retries also ended the loser's transaction, once
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    assert result.aborts.aborted == [loser.transactional_id] and result.aborts.pending == []
    calls = kafka_calls(kafka)
    assert CommitOut.of(c.commit(NAME, 0, 1, gen, [won(winner)], ACTOR)) == CommitOut.of(result)
    assert kafka_calls(kafka) == calls
    assert_invariants(c, settled=True)


def test_losers_are_aborted_even_while_the_winners_commit_waits(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    winner = c.begin_partition(NAME, 0, 1, gen, 0, 1)
    loser = c.begin_partition(NAME, 0, 1, gen, 0, 2)
    kafka.fail_next(ControlPlaneError("coordinator moving", retriable=True))  # only the winner's commit
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, 1, gen, [won(winner)], ACTOR)
    assert lease_state(c, winner.id) is LeaseState.COMMITTING
    assert lease_state(c, loser.id) is LeaseState.ABORTED
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    assert c.resume(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
    assert committed_events(c, 0) == [("recovery", {"batch_id": 0, "attempt": 1, "by": "resume"})]
    assert_invariants(c, settled=True)


def test_resume_via_resume_call_and_by_a_later_batch(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen, winner, loser = _decided_but_unfinished(c, kafka)
    # the driver moves on: beginning batch 1 finishes batch 0's decided commit first
    begun = c.begin_checkpoint(NAME, 1, gen, ACTOR)
    assert begun.action is BeginAction.NEW_ATTEMPT
    assert c.checkpoint_detail(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
    assert [t.transactional_id for _, t in kafka.commits] == [winner.transactional_id]
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    # resume of a finished commit answers from the record, with the loser aborted
    resumed = c.resume(NAME, 0)
    assert resumed.checkpoint.state is CheckpointState.COMMITTED
    assert lease_state(c, loser.id) is LeaseState.ABORTED
    assert [t.transactional_id for _, t in kafka.commits] == [winner.transactional_id]
    refused(c, kafka, lambda: c.resume(NAME, 1), e.NOT_COMMITTING)
    assert_invariants(c, settled=True)


# --- the commit's refusals -------------------------------------------------------------------


def test_a_commit_naming_bad_winners_is_refused_and_changes_nothing(
        coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    a, b = claimed(c, 0, 1, gen, 2)
    c.begin_checkpoint(NAME, 1, gen, ACTOR)  # batch 0's attempt superseded: its leases are not batch 1's
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    x, y = claimed(c, 0, 2, gen, 2, first_task=200)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, gen, [won(a), won(y)], ACTOR), e.STALE_LEASE)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, gen, [PR(0, y.id, record(y)), empty(1)], ACTOR), e.LEASE_MISMATCH)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, gen, [PR(0, x.id), won(y)], ACTOR), e.WINNER_NOT_PRECOMMITTED)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, gen, [won(y)], ACTOR), "partitions_incomplete", e.Invalid)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, gen, [empty(p) for p in range(257)], ACTOR),
            "too_many_partitions", e.Invalid)
    # the record of a try that does not hold the lease (issue 50 §2)
    stranger = PR(0, x.id, record(y))
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, gen, [stranger, won(y)], ACTOR), e.LEASE_NOT_CLAIMED)
    result = c.commit(NAME, 0, 2, gen, [won(x), won(y)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert sorted(t.transactional_id for _, t in kafka.commits) == ids_of([x, y])
    assert sorted(b for _, b in kafka.aborts) == ids_of([a, b])  # batch 0's first attempt, superseded
    assert_invariants(c, settled=True)


def test_commits_of_fenced_superseded_or_decided_attempts_change_nothing(
        coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=2)
    old = claimed(c, 0, 1, g1, 2)
    g2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)  # the driver restarted
    c.begin_checkpoint(NAME, 0, g2, ACTOR, partitions=2)
    new = claimed(c, 0, 2, g2, 2, first_task=200)
    # the zombie driver (generation 1), for its own attempt and for the new one
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, g1, [won(x) for x in old], ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g1, [won(x) for x in new], ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g2 + 1, [won(x) for x in new], ACTOR), e.UNKNOWN_GENERATION)
    # the current generation naming the attempt its restart superseded
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, g2, [won(x) for x in old], ACTOR), e.STALE_ATTEMPT)
    result = c.commit(NAME, 0, 2, g2, [won(x) for x in new], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    # decided: nothing more for any attempt of the batch, and a retry must name the same winners
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, g2, [won(x) for x in old], ACTOR), e.COMMIT_DECIDED)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g2, [won(new[0]), empty(1)], ACTOR), e.WINNER_MISMATCH)
    assert CommitOut.of(c.commit(NAME, 0, 2, g2, [won(x) for x in new], ACTOR)) == CommitOut.of(result)
    assert_invariants(c, settled=True)


def test_unknown_checkpoint_and_attempt_are_404(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    refused(c, kafka, lambda: c.commit(NAME, 0, 3, gen, [empty(0)], ACTOR), "unknown_attempt", e.NotFound)
    refused(c, kafka, lambda: c.commit(NAME, 9, 1, gen, [empty(0)], ACTOR), "unknown_checkpoint", e.NotFound)
    refused(c, kafka, lambda: c.resume(NAME, 9), "unknown_checkpoint", e.NotFound)


# --- the timeout gate (I4) -------------------------------------------------------------------


def _two_leases(c: Coordinator, clock: ManualClock) -> tuple[int, Lease, Lease]:
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    a = c.begin_partition(NAME, 0, 1, gen, 0, 1)
    b = c.begin_partition(NAME, 0, 1, gen, 1, 2)
    clock.advance(ms=1000)
    return gen, a, b


def test_commit_refused_within_the_margin_aborts_the_attempt(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen, a, b = _two_leases(c, clock)
    # 1 ms inside the margin of the deadline
    clock.advance(ms=(a.deadline_at - clock.now()).total_seconds() * 1000 - MARGIN_MS + 1)
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, 1, gen, [won(a), won(b)], ACTOR)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE
    assert sorted(exc.value.detail["lease_ids"]) == sorted([a.id, b.id])
    d = c.checkpoint_detail(NAME, 0)
    assert d.checkpoint.state is CheckpointState.OPEN and d.checkpoint.committed_attempt is None
    assert d.attempts[0].state is AttemptState.ABORTED and d.attempts[0].abort_reason == e.DEADLINE_TOO_CLOSE
    assert {x.state for x in d.leases} == {LeaseState.ABORTED}
    assert kafka.commits == []
    assert sorted(t for _, t in kafka.aborts) == ids_of([a, b])
    assert held(c) == [] and quarantined(c) == {a.ordinal, b.ordinal}
    assert "commit_refused" in event_kinds(c)
    assert_invariants(c, settled=True)

    # the retry gets the same answer and changes nothing
    err = refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [won(a), won(b)], ACTOR), e.DEADLINE_TOO_CLOSE)
    assert err.status == 409
    # Spark replays the batch under a new attempt
    again = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    assert again.action is BeginAction.NEW_ATTEMPT and again.attempt.number == 2
    assert sorted(again.older_aborted) == ids_of([a, b])


def test_commit_exactly_at_the_margin_is_decided(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen, a, b = _two_leases(c, clock)
    clock.advance(ms=(a.deadline_at - clock.now()).total_seconds() * 1000 - MARGIN_MS)
    assert (a.deadline_at - clock.now()).total_seconds() * 1000 == MARGIN_MS
    result = c.commit(NAME, 0, 1, gen, [won(a), won(b)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert result.attempt.decided_at == clock.now()
    assert len(kafka.commits) == 2 and kafka.aborts == []
    assert_invariants(c, settled=True)


def test_the_gate_counts_from_the_claim_not_from_begin(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    """A pre-lease's deadline is reset when a try claims it: the broker's clock for its
    transaction starts no earlier than the try's producer, which starts after the claim."""
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    clock.advance(ms=30_000)  # the first try asks half a timeout after begin
    (x,) = claimed(c, 0, 1, gen, 1)
    assert x.deadline_at == clock.now() + (x.deadline_at - x.leased_at) and x.leased_at == clock.now()
    clock.advance(ms=TIMEOUT_MS - MARGIN_MS)  # 36 s after the claim, 66 s after begin: still inside
    assert c.commit(NAME, 0, 1, gen, [won(x)], ACTOR).checkpoint.state is CheckpointState.COMMITTED


def test_expired_lease_cannot_be_committed(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen, a, b = _two_leases(c, clock)
    clock.advance(seconds=3600)
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, 1, gen, [won(a), empty(1)], ACTOR)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE
    assert kafka.commits == []
    assert sorted(t for _, t in kafka.aborts) == ids_of([a, b])


def test_a_winner_the_recovery_loop_aborted_at_its_deadline_gets_the_gates_answer(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen, a, b = _two_leases(c, clock)
    clock.advance(ms=TIMEOUT_MS)
    expired, outcome = c.abort_expired_leases(NAME)
    assert sorted(x.id for x in expired) == sorted([a.id, b.id]) and sorted(outcome.aborted) == ids_of([a, b])
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, 1, gen, [won(a), won(b)], ACTOR)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE
    assert c.checkpoint_detail(NAME, 0).attempts[0].abort_reason == e.DEADLINE_TOO_CLOSE
    assert kafka.commits == [] and len(kafka.aborts) == 2
    assert_invariants(c, settled=True)


# --- empty partitions ------------------------------------------------------------------------


def test_empty_partitions_and_all_empty_batches(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    x = c.begin_partition(NAME, 0, 1, gen, 1, 1)
    result = c.commit(NAME, 0, 1, gen, [empty(0), won(x), empty(2)], ACTOR)
    assert result.attempt.partitions == 3 and [w.partition for w in result.winners] == [1]
    assert [t.transactional_id for _, t in kafka.commits] == [x.transactional_id]

    for batch, n in ((1, 4), (2, 0)):  # all partitions empty; no partitions at all
        c.begin_checkpoint(NAME, batch, gen, ACTOR, partitions=n)
        calls = kafka_calls(kafka)
        done = c.commit(NAME, batch, 1, gen, [empty(p) for p in range(n)], ACTOR)
        assert done.checkpoint.state is CheckpointState.COMMITTED and done.winners == []
        assert done.attempt.partitions == n and done.attempt.state is AttemptState.COMMITTED
        assert kafka_calls(kafka) == calls  # nothing to commit, and unclaimed pre-leases need no abort
        assert c.begin_checkpoint(NAME, batch, gen, ACTOR).action is BeginAction.SKIP
    assert held(c) == [] and quarantined(c) == set()
    assert_invariants(c, settled=True)


# --- no Kafka control plane ------------------------------------------------------------------


def test_unconfigured_control_plane_refuses_to_decide(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane
):
    gen = start(offline)
    offline.begin_checkpoint(NAME, 0, gen, ACTOR)
    x = offline.begin_partition(NAME, 0, 1, gen, 0, 1)
    err = refused(offline, kafka, lambda: offline.commit(NAME, 0, 1, gen, [won(x)], ACTOR),
                  e.NO_CONTROL_PLANE, e.Unavailable)
    assert err.status == 503
    d = offline.checkpoint_detail(NAME, 0)
    assert d.checkpoint.state is CheckpointState.OPEN and d.attempts[0].state is AttemptState.OPEN
    assert d.leases[0].state is LeaseState.LEASED
    # with a control plane the same call decides and commits
    result = coordinator.commit(NAME, 0, 1, gen, [won(x)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert_invariants(coordinator, settled=True)


def test_unconfigured_control_plane_cannot_finish_a_decided_commit(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane
):
    gen, winner, _ = _decided_but_unfinished(coordinator, kafka)
    refused(offline, kafka, lambda: offline.resume(NAME, 0), e.NO_CONTROL_PLANE, e.Unavailable)
    gen2, _ = offline.start_generation(NAME, "q1", "r2", ACTOR)
    with pytest.raises(e.Unavailable) as exc:
        offline.begin_checkpoint(NAME, 0, gen2, ACTOR)
    assert exc.value.reason == e.NO_CONTROL_PLANE
    assert offline.checkpoint_detail(NAME, 0).checkpoint.state is CheckpointState.COMMITTING
    assert coordinator.begin_checkpoint(NAME, 0, gen2, ACTOR).checkpoint.state is CheckpointState.COMMITTED
    assert_invariants(coordinator, settled=True)
