"""The protocol's three state machines (coordinator/protocol/states.py): exactly the legal moves,
no way back from an end, and the named groups of lease states the rules and the store use."""

from __future__ import annotations

import itertools

import pytest

from coordinator.protocol.errors import IllegalTransition
from coordinator.protocol.states import (
    ABORT_PENDING_STATES,
    ATTEMPT_TRANSITIONS,
    CHECKPOINT_TRANSITIONS,
    LEASE_TRANSITIONS,
    LOST_LEASE_STATES,
    UNDECIDED_LEASE_STATES,
    UNRESOLVED_LEASE_STATES,
    WINNING_LEASE_STATES,
    AttemptState,
    CheckpointState,
    LeaseState,
    is_terminal,
    require_transition,
)

LEGAL = {
    CheckpointState: {
        (CheckpointState.OPEN, CheckpointState.COMMITTING),
        (CheckpointState.COMMITTING, CheckpointState.COMMITTED),
        (CheckpointState.COMMITTING, CheckpointState.LOST),
    },
    AttemptState: {
        (AttemptState.OPEN, AttemptState.COMMITTING),
        (AttemptState.OPEN, AttemptState.ABORTED),
        (AttemptState.COMMITTING, AttemptState.COMMITTED),
        (AttemptState.COMMITTING, AttemptState.LOST),
    },
    LeaseState: {
        (LeaseState.PRELEASED, LeaseState.LEASED),  # the first try to ask claims it
        (LeaseState.PRELEASED, LeaseState.ABORTED),  # no try claimed it: freed, nothing on Kafka
        (LeaseState.LEASED, LeaseState.COMMITTING),  # a winner, its record stored with the decision
        (LeaseState.LEASED, LeaseState.ABORTING),  # a try that did not win, or its attempt ended
        (LeaseState.COMMITTING, LeaseState.COMMITTED),
        (LeaseState.COMMITTING, LeaseState.LOST_ABORTING),
        (LeaseState.ABORTING, LeaseState.ABORTED),
        (LeaseState.LOST_ABORTING, LeaseState.LOST),
    },
}


@pytest.mark.parametrize("enum", list(LEGAL), ids=lambda x: x.__name__)
def test_require_transition_accepts_exactly_the_legal_moves(enum):
    legal = LEGAL[enum]
    for old, new in itertools.product(list(enum), list(enum)):
        if (old, new) in legal:
            require_transition(old, new)
        else:
            with pytest.raises(IllegalTransition):
                require_transition(old, new)


def test_tables_match_the_expected_moves():
    for enum, table in [
        (CheckpointState, CHECKPOINT_TRANSITIONS),
        (AttemptState, ATTEMPT_TRANSITIONS),
        (LeaseState, LEASE_TRANSITIONS),
    ]:
        assert set(table) == set(enum)
        assert {(o, n) for o, targets in table.items() for n in targets} == LEGAL[enum]


def test_require_transition_rejects_a_move_across_machines():
    # same string value, different machine
    with pytest.raises(IllegalTransition):
        require_transition(AttemptState.OPEN, CheckpointState.COMMITTING)
    with pytest.raises(IllegalTransition):
        require_transition(LeaseState.LEASED, AttemptState.COMMITTING)


def test_no_way_back_from_committed_or_aborted():
    for old in (CheckpointState.COMMITTED, AttemptState.COMMITTED, LeaseState.COMMITTED):
        for new in type(old):
            with pytest.raises(IllegalTransition):
                require_transition(old, new)
    # an abort can never turn into a commit (I2)
    for new in (AttemptState.COMMITTING, AttemptState.COMMITTED, AttemptState.OPEN):
        with pytest.raises(IllegalTransition):
            require_transition(AttemptState.ABORTED, new)
    for old in (LeaseState.ABORTING, LeaseState.ABORTED):
        for new in (LeaseState.COMMITTING, LeaseState.COMMITTED, LeaseState.LEASED, LeaseState.PRELEASED):
            with pytest.raises(IllegalTransition):
                require_transition(old, new)
    # a decided winner cannot be aborted any more, and a pre-lease cannot win without a try holding it
    with pytest.raises(IllegalTransition):
        require_transition(LeaseState.COMMITTING, LeaseState.ABORTING)
    with pytest.raises(IllegalTransition):
        require_transition(LeaseState.PRELEASED, LeaseState.COMMITTING)
    # an unclaimed pre-lease has no producer: it never goes to Kafka for an abort
    with pytest.raises(IllegalTransition):
        require_transition(LeaseState.PRELEASED, LeaseState.ABORTING)


def test_terminal_states():
    terminal = {s for enum in LEGAL for s in enum if is_terminal(s)}
    assert terminal == {
        CheckpointState.COMMITTED,
        CheckpointState.LOST,
        AttemptState.COMMITTED,
        AttemptState.ABORTED,
        AttemptState.LOST,
        LeaseState.COMMITTED,
        LeaseState.ABORTED,
        LeaseState.LOST,
    }


def test_the_named_groups_of_lease_states():
    # unresolved: the id may hold a transaction (or a try may still claim it): exactly the non-terminal states
    assert UNRESOLVED_LEASE_STATES == {LeaseState.PRELEASED, LeaseState.LEASED, LeaseState.COMMITTING,
                                       LeaseState.ABORTING, LeaseState.LOST_ABORTING}
    assert UNRESOLVED_LEASE_STATES == {s for s in LeaseState if not is_terminal(s)}
    assert ABORT_PENDING_STATES == {LeaseState.ABORTING: LeaseState.ABORTED,
                                    LeaseState.LOST_ABORTING: LeaseState.LOST}
    for pending, done in ABORT_PENDING_STATES.items():
        require_transition(pending, done)
    assert LOST_LEASE_STATES == {LeaseState.LOST_ABORTING, LeaseState.LOST}
    assert WINNING_LEASE_STATES == {LeaseState.COMMITTING, LeaseState.COMMITTED, LeaseState.LOST_ABORTING,
                                    LeaseState.LOST}
    assert UNDECIDED_LEASE_STATES == {LeaseState.PRELEASED, LeaseState.LEASED}
