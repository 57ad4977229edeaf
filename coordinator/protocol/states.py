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


class AttemptState(StrEnum):
    OPEN = "OPEN"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"  # superseded, abandoned, refused by the timeout gate, or aborted by hand


class LeaseState(StrEnum):
    LEASED = "LEASED"  # id handed to a task attempt; a transaction may be open on it
    PRECOMMITTED = "PRECOMMITTED"  # flushed, producer id and epoch stored
    COMMITTING = "COMMITTING"  # chosen winner of a decided commit
    COMMITTED = "COMMITTED"
    ABORTING = "ABORTING"  # must be aborted on Kafka before its id is free again
    ABORTED = "ABORTED"


class TransactionalIdState(StrEnum):
    FREE = "FREE"  # known to hold no unresolved transaction: may be leased (I3)
    LEASED = "LEASED"  # held by exactly one lease that is not yet resolved


CHECKPOINT_TRANSITIONS: dict[CheckpointState, frozenset[CheckpointState]] = {
    CheckpointState.OPEN: frozenset({CheckpointState.COMMITTING}),
    CheckpointState.COMMITTING: frozenset({CheckpointState.COMMITTED}),
    CheckpointState.COMMITTED: frozenset(),
}

ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.OPEN: frozenset({AttemptState.COMMITTING, AttemptState.ABORTED}),
    AttemptState.COMMITTING: frozenset({AttemptState.COMMITTED}),
    AttemptState.COMMITTED: frozenset(),
    AttemptState.ABORTED: frozenset(),
}

LEASE_TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.LEASED: frozenset({LeaseState.PRECOMMITTED, LeaseState.ABORTING}),
    LeaseState.PRECOMMITTED: frozenset({LeaseState.COMMITTING, LeaseState.ABORTING}),
    LeaseState.COMMITTING: frozenset({LeaseState.COMMITTED}),
    LeaseState.COMMITTED: frozenset(),
    LeaseState.ABORTING: frozenset({LeaseState.ABORTED}),
    LeaseState.ABORTED: frozenset(),
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
    {LeaseState.LEASED, LeaseState.PRECOMMITTED, LeaseState.COMMITTING, LeaseState.ABORTING}
)
# Leases of an attempt that has not been decided yet and that must end aborted if it is not.
UNDECIDED_LEASE_STATES = frozenset({LeaseState.LEASED, LeaseState.PRECOMMITTED})


def require_transition(old: StrEnum, new: StrEnum) -> None:
    """Raise IllegalTransition unless `old -> new` is a move of its state machine."""
    table = _TABLES[type(old)]
    if type(new) is not type(old) or new not in table[old]:  # type: ignore[index]
        raise IllegalTransition(f"{type(old).__name__}: {old} -> {new} is not a legal transition")


def is_terminal(state: StrEnum) -> bool:
    return not _TABLES[type(state)][state]  # type: ignore[index]
