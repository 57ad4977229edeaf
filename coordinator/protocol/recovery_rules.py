"""What the recovery loop (DESIGN.md §3 step 6) must do, decided from plain records.

Each function takes rows the loop read (and `now` from the coordinator's clock) and returns what
to act on; the loop does the I/O (coordinator/service/recovery.py and recovery_steps.py), every
state change still a compare-and-set, so a stale decision changes nothing.

A pass's work follows what is due, not how many sinks exist: `due_work` reads only decided commits
and unresolved leases (the transactions that may be open), which an idle sink has none of.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol, TypeVar

from . import rules
from .model import Checkpoint, Lease
from .states import ABORT_PENDING_STATES, UNDECIDED_LEASE_STATES, UNRESOLVED_LEASE_STATES, CheckpointState, LeaseState

WARN_FRACTION = 0.8  # warn at 80 % of a transaction's lifetime


class Step(StrEnum):
    """The loop's steps for one sink, in the order they run."""

    FINISH = "finish"  # decided commits: first, and never behind another sink's Kafka calls
    ABORTS = "pending_aborts"
    EXPIRED = "expired_leases"
    NEAR_TIMEOUT = "near_timeout"


@dataclass(frozen=True)
class SinkTimes:
    """What the rules need of a sink's configuration."""

    commit_margin_ms: int
    transaction_timeout_ms: int


@dataclass
class DueWork:
    """The steps each sink has work for, by sink id."""

    steps: dict[int, set[Step]] = field(default_factory=dict)

    def add(self, sink_id: int, step: Step) -> None:
        self.steps.setdefault(sink_id, set()).add(step)


def due_work(
    decided: Iterable[Checkpoint], unresolved: Iterable[Lease], sinks: Mapping[int, SinkTimes], now: datetime,
    grace_ms: int = 0,
) -> DueWork:
    """Which sinks have which steps to do, from their decided commits (COMMITTING and LOST
    checkpoints) and their unresolved leases."""
    decided, unresolved = list(decided), list(unresolved)
    sink_of = {c.id: c.sink_id for c in decided}
    due = DueWork()
    for cp_id in checkpoints_to_finish(decided, unresolved, now, grace_ms):
        due.add(sink_of[cp_id], Step.FINISH)
    for x in unresolved:
        if x.state in ABORT_PENDING_STATES:
            due.add(x.sink_id, Step.ABORTS)
    by_sink: dict[int, list[Lease]] = {}
    for x in unresolved:
        by_sink.setdefault(x.sink_id, []).append(x)
    for sink_id, leases in by_sink.items():
        times = sinks.get(sink_id)
        if times is None:  # retired since it was read
            continue
        if expired_leases(leases, now, times.commit_margin_ms):
            due.add(sink_id, Step.EXPIRED)
        if near_timeout(leases, now, times.transaction_timeout_ms):
            due.add(sink_id, Step.NEAR_TIMEOUT)
    return due


def checkpoints_to_finish(
    checkpoints: Iterable[Checkpoint], leases: Iterable[Lease], now: datetime | None = None, grace_ms: int = 0,
) -> list[int]:
    """Decided commits still to finish: COMMITTING checkpoints (even with no winner left to commit:
    the crash may have come between the last winner and the final mark), and LOST ones whose other
    winners are still to commit (the refused winner does not stop the others). With `grace_ms`,
    only those decided at least that long before `now`: a younger decision is left to the call that
    made it, which is still committing it (the loop's EndTxn would race its own)."""
    with_winners = {x.checkpoint_id for x in leases if x.state is LeaseState.COMMITTING}
    out = [
        c.id for c in checkpoints
        if (c.state is CheckpointState.COMMITTING or (c.state is CheckpointState.LOST and c.id in with_winners))
        and not decided_within(c, now, grace_ms)
    ]
    return sorted(set(out))


def decided_within(checkpoint: Checkpoint, now: datetime | None, grace_ms: int) -> bool:
    """Whether the checkpoint was decided less than grace_ms before now."""
    if grace_ms <= 0 or checkpoint.decided_at is None:
        return False
    assert now is not None, "a grace needs the time"
    return checkpoint.decided_at > now - timedelta(milliseconds=grace_ms)


def expired_leases(leases: Iterable[Lease], now: datetime, margin_ms: int) -> list[Lease]:
    """Undecided leases (their attempt is open: a decision or an abort would have ended them) whose
    transaction can never pass the commit gate any more (closer to its broker deadline than the
    margin; time only moves on): abort them now rather than leave the id, and the transaction
    blocking read_committed readers, until the next begin."""
    return [x for x in leases if x.state in UNDECIDED_LEASE_STATES and rules.deadline_too_close(x, now, margin_ms)]


# the leases near_timeout looks at: their transactions may hold data the batch needs
NEAR_TIMEOUT_STATES = (LeaseState.LEASED, LeaseState.COMMITTING)


def near_timeout(
    leases: Iterable[Lease], now: datetime, transaction_timeout_ms: int, fraction: float = WARN_FRACTION
) -> list[Lease]:
    """Transactions held by a try (or decided but not yet committed) past `fraction` of their
    lifetime: the broker aborts them at the timeout, and a decided one would then be lost."""
    return [
        x for x in leases
        if x.state in NEAR_TIMEOUT_STATES
        and rules.transaction_age_fraction(x, now, transaction_timeout_ms) >= fraction
    ]


class _HasTransactionalId(Protocol):
    @property
    def transactional_id(self) -> str: ...


T = TypeVar("T", bound=_HasTransactionalId)

# Kafka's states of a transaction the broker is already completing: it ends without help.
COMPLETING_STATES = frozenset({"PrepareCommit", "PrepareAbort", "PrepareEpochFence"})


def lingering(open_transactions: Sequence[T], unresolved: Iterable[Lease], *, include_completing: bool = False) -> list[T]:
    """Open transactions on the broker that no unresolved lease explains: nothing in the database
    may commit them, and each blocks read_committed readers of its partitions. (An id held by an
    unresolved lease is explained: that lease's own commit or abort ends it.) Those the broker is
    already completing are left out unless `include_completing`."""
    explained = {x.transactional_id for x in unresolved if x.state in UNRESOLVED_LEASE_STATES}
    seen: set[str] = set()
    out = []
    for t in open_transactions:
        if not include_completing and getattr(t, "state", None) in COMPLETING_STATES:
            continue
        if t.transactional_id not in explained and t.transactional_id not in seen:
            seen.add(t.transactional_id)
            out.append(t)
    return out
