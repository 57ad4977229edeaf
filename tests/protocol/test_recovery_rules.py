"""What the recovery loop decides (coordinator/protocol/recovery_rules.py), from plain records: which
sinks have which steps due (work follows what is due, not how many sinks exist), which decided
commits to finish (after the deciding call's grace), which leases expired, which transactions are
near their timeout, and which open transactions on a broker nothing explains. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.protocol.recovery_rules import (
    NEAR_TIMEOUT_STATES,
    SinkTimes,
    Step,
    checkpoints_to_finish,
    decided_within,
    due_work,
    expired_leases,
    lingering,
    near_timeout,
)
from coordinator.protocol.states import CheckpointState, LeaseState
from fixtures.protocol_records import MARGIN_MS, T0, TIMEOUT_MS, checkpoint, decided, lease, ms, pre_lease

TIMES = {1: SinkTimes(commit_margin_ms=MARGIN_MS, transaction_timeout_ms=TIMEOUT_MS),
         2: SinkTimes(commit_margin_ms=MARGIN_MS, transaction_timeout_ms=TIMEOUT_MS)}
EXPIRED_AT = T0 + ms(TIMEOUT_MS - MARGIN_MS + 1)  # a lease leased at T0 can no longer pass the gate


@dataclass(frozen=True)
class Open:
    transactional_id: str
    state: str = "Ongoing"


# --- decided commits ------------------------------------------------------------------------


def test_checkpoints_to_finish():
    committing = checkpoint(id=1, state=CheckpointState.COMMITTING, decided_at=T0)
    lost_with_winner_left = checkpoint(id=2, state=CheckpointState.LOST, decided_at=T0)
    lost_done = checkpoint(id=3, state=CheckpointState.LOST, decided_at=T0)
    committed = checkpoint(id=4, state=CheckpointState.COMMITTED, decided_at=T0)
    still = [decided(id=10, checkpoint_id=2)]  # a winner of the LOST checkpoint still to commit
    assert checkpoints_to_finish([lost_done, committed, lost_with_winner_left, committing], still) == [1, 2]
    # a COMMITTING checkpoint with no winner left still needs its final mark
    assert checkpoints_to_finish([committing], []) == [1]


def test_a_young_decision_is_left_to_the_call_that_made_it():
    cp = checkpoint(id=1, state=CheckpointState.COMMITTING, decided_at=T0)
    assert checkpoints_to_finish([cp], [], T0 + ms(11_999), grace_ms=12_000) == []
    assert checkpoints_to_finish([cp], [], T0 + ms(12_000), grace_ms=12_000) == [1]
    assert checkpoints_to_finish([cp], [], T0, grace_ms=0) == [1]
    assert decided_within(cp, T0 + ms(1), 12_000) and not decided_within(cp, T0 + ms(12_000), 12_000)
    assert not decided_within(checkpoint(decided_at=None), T0, 12_000)


# --- leases ---------------------------------------------------------------------------------


def test_expired_leases_are_the_undecided_ones_past_the_gate():
    claimed = lease(id=1)
    unclaimed = pre_lease(id=2, ordinal=1)
    young = lease(id=3, ordinal=2, leased_at=T0 + ms(30_000))
    winner = decided(id=4, ordinal=3)  # decided: the recovery loop finishes it, never aborts it
    aborting = lease(id=5, ordinal=4, state=LeaseState.ABORTING)
    every = [claimed, unclaimed, young, winner, aborting]
    assert expired_leases(every, T0 + ms(TIMEOUT_MS - MARGIN_MS), MARGIN_MS) == []  # exactly the margin left
    assert [x.id for x in expired_leases(every, EXPIRED_AT, MARGIN_MS)] == [1, 2]


def test_near_timeout_looks_at_leases_a_try_holds_and_decided_winners():
    assert set(NEAR_TIMEOUT_STATES) == {LeaseState.LEASED, LeaseState.COMMITTING}
    every = [lease(id=1), pre_lease(id=2, ordinal=1), decided(id=3, ordinal=2),
             lease(id=4, ordinal=3, state=LeaseState.ABORTING), lease(id=5, ordinal=4, leased_at=T0 + ms(1))]
    at_80 = T0 + ms(48_000)
    assert [x.id for x in near_timeout(every, at_80, TIMEOUT_MS)] == [1, 3]
    assert [x.id for x in near_timeout(every, at_80 + ms(1), TIMEOUT_MS)] == [1, 3, 5]
    assert near_timeout(every, at_80 - ms(1), TIMEOUT_MS) == []


def test_due_work_follows_what_is_due_not_the_sinks():
    decided_cps = [checkpoint(id=1, sink_id=1, state=CheckpointState.COMMITTING, decided_at=T0)]
    unresolved = [
        decided(id=1, checkpoint_id=1),
        lease(id=2, sink_id=2, checkpoint_id=2, ordinal=0, state=LeaseState.ABORTING),
        lease(id=3, sink_id=2, checkpoint_id=2, ordinal=1),
    ]
    due = due_work(decided_cps, unresolved, TIMES, T0 + ms(1_000))
    assert due.steps == {1: {Step.FINISH}, 2: {Step.ABORTS}}
    due = due_work(decided_cps, unresolved, TIMES, T0 + ms(55_000))
    assert due.steps == {1: {Step.FINISH, Step.NEAR_TIMEOUT}, 2: {Step.ABORTS, Step.NEAR_TIMEOUT, Step.EXPIRED}}
    # nothing due for an idle sink, nothing at all for a quiet deployment
    assert due_work([], [], TIMES, T0).steps == {}
    # a decision younger than the grace is not the loop's yet
    assert due_work(decided_cps, unresolved[:1], TIMES, T0 + ms(1_000), grace_ms=12_000).steps == {}
    # a sink retired since its leases were read is skipped
    assert due_work([], unresolved[1:], {}, T0 + ms(50_000)).steps == {2: {Step.ABORTS}}


def test_step_order_finishes_decided_commits_first():
    assert list(Step) == [Step.FINISH, Step.ABORTS, Step.EXPIRED, Step.NEAR_TIMEOUT]


# --- the lingering sweep ---------------------------------------------------------------------


def test_lingering_is_what_no_unresolved_lease_explains():
    leases = [lease(id=1, ordinal=0), pre_lease(id=2, ordinal=1),
              lease(id=3, ordinal=2, state=LeaseState.ABORTED, resolved_at=T0)]
    found = [Open("p-0"), Open("p-1"), Open("p-2"), Open("p-9"), Open("p-9")]
    # p-0 and p-1 are held (a pre-lease holds its id too); p-2's lease is resolved; p-9 once
    assert [t.transactional_id for t in lingering(found, leases)] == ["p-2", "p-9"]


def test_lingering_leaves_out_what_the_broker_is_already_completing():
    found = [Open("p-5", "PrepareCommit"), Open("p-6", "PrepareAbort"), Open("p-7", "PrepareEpochFence"),
             Open("p-8", "Ongoing")]
    assert [t.transactional_id for t in lingering(found, [])] == ["p-8"]
    assert [t.transactional_id for t in lingering(found, [], include_completing=True)] == ["p-5", "p-6", "p-7", "p-8"]
