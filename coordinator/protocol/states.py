"""The four state machines of the protocol (DESIGN.md §3) and their legal transitions.

Every state change the storage layer makes is a compare-and-set from one of these old states to
one of these new states; `require_transition` is the single place that says which moves exist.
"""

from __future__ import annotations

from enum import StrEnum

from .errors import IllegalTransition


class CheckpointState(StrEnum):
    OPEN = "OPEN"  # attempts may write; nothing decided
    COMMITTING = "COMMITTING"  # commit decided durably, winners being committed on Kafka
    COMMITTED = "COMMITTED"  # every winner committed; final (I1)
    # Kafka refused a decided winner's commit for good (fenced, timed out, unknown producer id):
    # that partition's data is lost. Final; the sink is halted until an operator acknowledges.
    LOST = "LOST"


class AttemptState(StrEnum):
    OPEN = "OPEN"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"  # superseded, abandoned, refused by the timeout gate, or aborted by hand
    LOST = "LOST"  # decided, but Kafka refused a winner's commit for good (its checkpoint is LOST)


class LeaseState(StrEnum):
    LEASED = "LEASED"  # id handed to a task attempt; a transaction may be open on it
    PRECOMMITTED = "PRECOMMITTED"  # flushed, producer id and epoch stored
    COMMITTING = "COMMITTING"  # chosen winner of a decided commit
    COMMITTED = "COMMITTED"
    ABORTING = "ABORTING"  # must be aborted on Kafka before its id is free again
    ABORTED = "ABORTED"
    # a winner whose commit Kafka refused for good: its id is fenced (aborted) on Kafka before it
    # is free again, like ABORTING, and the lease then ends LOST
    LOST_ABORTING = "LOST_ABORTING"
    LOST = "LOST"


class TransactionalIdState(StrEnum):
    FREE = "FREE"  # known to hold no unresolved transaction: may be leased (I3)
    LEASED = "LEASED"  # held by exactly one lease that is not yet resolved


CHECKPOINT_TRANSITIONS: dict[CheckpointState, frozenset[CheckpointState]] = {
    CheckpointState.OPEN: frozenset({CheckpointState.COMMITTING}),
    CheckpointState.COMMITTING: frozenset({CheckpointState.COMMITTED, CheckpointState.LOST}),
    CheckpointState.COMMITTED: frozenset(),
    CheckpointState.LOST: frozenset(),
}

ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.OPEN: frozenset({AttemptState.COMMITTING, AttemptState.ABORTED}),
    AttemptState.COMMITTING: frozenset({AttemptState.COMMITTED, AttemptState.LOST}),
    AttemptState.COMMITTED: frozenset(),
    AttemptState.ABORTED: frozenset(),
    AttemptState.LOST: frozenset(),
}

LEASE_TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    # LEASED -> COMMITTING: a winner whose pre-commit record came with the commit (stored with the
    # decision); LEASED -> ABORTED: a first try's pre-lease whose partition was empty (no producer
    # ever existed on it, so there is nothing to abort on Kafka)
    LeaseState.LEASED: frozenset(
        {LeaseState.PRECOMMITTED, LeaseState.COMMITTING, LeaseState.ABORTING, LeaseState.ABORTED}
    ),
    LeaseState.PRECOMMITTED: frozenset({LeaseState.COMMITTING, LeaseState.ABORTING}),
    LeaseState.COMMITTING: frozenset({LeaseState.COMMITTED, LeaseState.LOST_ABORTING}),
    LeaseState.COMMITTED: frozenset(),
    LeaseState.ABORTING: frozenset({LeaseState.ABORTED}),
    LeaseState.ABORTED: frozenset(),
    LeaseState.LOST_ABORTING: frozenset({LeaseState.LOST}),
    LeaseState.LOST: frozenset(),
}

TRANSACTIONAL_ID_TRANSITIONS: dict[TransactionalIdState, frozenset[TransactionalIdState]] = {
    TransactionalIdState.FREE: frozenset({TransactionalIdState.LEASED}),
    TransactionalIdState.LEASED: frozenset({TransactionalIdState.FREE}),
}

_TABLES = {
    CheckpointState: CHECKPOINT_TRANSITIONS,
    AttemptState: ATTEMPT_TRANSITIONS,
    LeaseState: LEASE_TRANSITIONS,
    TransactionalIdState: TRANSACTIONAL_ID_TRANSITIONS,
}

# Leases whose transactional id may still hold an unresolved transaction on the broker.
UNRESOLVED_LEASE_STATES = frozenset(
    {LeaseState.LEASED, LeaseState.PRECOMMITTED, LeaseState.COMMITTING, LeaseState.ABORTING, LeaseState.LOST_ABORTING}
)
# Leases whose transaction must still be aborted on Kafka, and the state each ends in after it.
ABORT_PENDING_STATES: dict[LeaseState, LeaseState] = {
    LeaseState.ABORTING: LeaseState.ABORTED,
    LeaseState.LOST_ABORTING: LeaseState.LOST,
}
# Leases of a decided winner whose commit Kafka refused for good.
LOST_LEASE_STATES = frozenset({LeaseState.LOST_ABORTING, LeaseState.LOST})
# Leases of a decided attempt's winners, whatever their commit on Kafka came to.
WINNING_LEASE_STATES = frozenset({LeaseState.COMMITTING, LeaseState.COMMITTED, *LOST_LEASE_STATES})
# Leases of an attempt that has not been decided yet and that must end aborted if it is not.
UNDECIDED_LEASE_STATES = frozenset({LeaseState.LEASED, LeaseState.PRECOMMITTED})


def require_transition(old: StrEnum, new: StrEnum) -> None:
    """Raise IllegalTransition unless `old -> new` is a move of its state machine."""
    table = _TABLES[type(old)]
    if type(new) is not type(old) or new not in table[old]:  # type: ignore[index]
        raise IllegalTransition(f"{type(old).__name__}: {old} -> {new} is not a legal transition")


def is_terminal(state: StrEnum) -> bool:
    return not _TABLES[type(state)][state]  # type: ignore[index]
