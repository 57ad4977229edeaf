"""The three state machines of the protocol (DESIGN.md §3) and their legal transitions.

Theory of operation, in one paragraph. A **checkpoint** is one micro-batch of one sink; it stays
OPEN while attempts write it, becomes COMMITTING when a commit is decided (durably, with every
winner's producer id and epoch), and COMMITTED once Kafka committed every winner (or LOST if Kafka
refused one for good). An **attempt** is one try at writing the checkpoint under one driver
generation. A **lease** is one pooled transactional id held for one partition of one attempt:
taken at begin for the partition's first try (PRELEASED), claimed by the task try that asks first
or granted fresh to any other try (LEASED), then chosen as its partition's winner (COMMITTING ->
COMMITTED) or ended on Kafka (ABORTING -> ABORTED). A lease is *unresolved* while its id may hold
an open transaction; the id goes back to the pool only when it is resolved (I3), after a
quarantine when a try that did not win may still reach the broker.

Every state change the store makes is a compare-and-set from the old states named here to one
new state; `require_transition` is the one place that says which moves exist, and
`docs/protocol.md` draws these tables (tests/test_docs.py checks the drawing against them).
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
    ABORTED = "ABORTED"  # superseded, fenced, refused by the timeout gate, or aborted by the driver
    LOST = "LOST"  # decided, but Kafka refused a winner's commit for good (its checkpoint is LOST)


class LeaseState(StrEnum):
    PRELEASED = "PRELEASED"  # taken at begin for a partition's first try; no try holds it yet
    LEASED = "LEASED"  # held by one task try (Spark's task attempt id): a transaction may be open on it
    COMMITTING = "COMMITTING"  # its partition's winner in a decided commit, pre-commit record stored
    COMMITTED = "COMMITTED"
    ABORTING = "ABORTING"  # must be aborted on Kafka before its id is free again
    ABORTED = "ABORTED"
    # a winner whose commit Kafka refused for good: its id is fenced on Kafka like ABORTING, then LOST
    LOST_ABORTING = "LOST_ABORTING"
    LOST = "LOST"


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
    # PRELEASED -> ABORTED: no try ever held it (its partition was empty, or every try asked after
    # the attempt ended), so no producer exists on it and there is nothing to abort on Kafka
    LeaseState.PRELEASED: frozenset({LeaseState.LEASED, LeaseState.ABORTED}),
    LeaseState.LEASED: frozenset({LeaseState.COMMITTING, LeaseState.ABORTING}),
    LeaseState.COMMITTING: frozenset({LeaseState.COMMITTED, LeaseState.LOST_ABORTING}),
    LeaseState.COMMITTED: frozenset(),
    LeaseState.ABORTING: frozenset({LeaseState.ABORTED}),
    LeaseState.ABORTED: frozenset(),
    LeaseState.LOST_ABORTING: frozenset({LeaseState.LOST}),
    LeaseState.LOST: frozenset(),
}

# Where an entity starts: a checkpoint and an attempt OPEN; a lease PRELEASED when begin takes it
# for a partition's first try, LEASED when it is granted to a try at once.
INITIAL_STATES: dict[type[StrEnum], tuple[StrEnum, ...]] = {
    CheckpointState: (CheckpointState.OPEN,),
    AttemptState: (AttemptState.OPEN,),
    LeaseState: (LeaseState.PRELEASED, LeaseState.LEASED),
}

_TABLES = {
    CheckpointState: CHECKPOINT_TRANSITIONS,
    AttemptState: ATTEMPT_TRANSITIONS,
    LeaseState: LEASE_TRANSITIONS,
}

# Leases whose transactional id may still hold an unresolved transaction on the broker: the id is
# not free (I3). The store keeps `resolved_at` NULL exactly for these.
UNRESOLVED_LEASE_STATES = frozenset(s for s in LeaseState if LEASE_TRANSITIONS[s])
# Leases a task try holds whose transaction may be open on the broker (a pre-lease no try claimed
# holds its id, but no producer ever used it)
MAY_HOLD_TRANSACTION = UNRESOLVED_LEASE_STATES - {LeaseState.PRELEASED}
# Leases whose transaction must still be aborted on Kafka, and the state each ends in after it.
ABORT_PENDING_STATES: dict[LeaseState, LeaseState] = {
    LeaseState.ABORTING: LeaseState.ABORTED,
    LeaseState.LOST_ABORTING: LeaseState.LOST,
}
# Leases of a decided winner whose commit Kafka refused for good.
LOST_LEASE_STATES = frozenset({LeaseState.LOST_ABORTING, LeaseState.LOST})
# Leases of a decided attempt's winners, whatever their commit on Kafka came to.
WINNING_LEASE_STATES = frozenset({LeaseState.COMMITTING, LeaseState.COMMITTED, *LOST_LEASE_STATES})
# Leases of an attempt that has not been decided yet: a decision or an abort ends them.
UNDECIDED_LEASE_STATES = frozenset({LeaseState.PRELEASED, LeaseState.LEASED})


def require_transition(old: StrEnum, new: StrEnum) -> None:
    """Raise IllegalTransition unless `old -> new` is a move of its state machine."""
    table = _TABLES[type(old)]
    if type(new) is not type(old) or new not in table[old]:  # type: ignore[index]
        raise IllegalTransition(f"{type(old).__name__}: {old} -> {new} is not a legal transition")


def is_terminal(state: StrEnum) -> bool:
    return not _TABLES[type(state)][state]  # type: ignore[index]
