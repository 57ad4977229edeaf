"""Invariants I1-I5 of DESIGN.md §3 as executable checks over a snapshot of the durable state.

`check_invariants(snapshot)` checks one snapshot (I2, I3, I4, the structural half of I1; F1: no
attempt of a fenced generation is still open; F2: a retired sink holds nothing open; and L1: lost
data is never silent -- every LOST checkpoint has a `data_lost` alert, and its sink stayed halted
until an operator acknowledged it);
`check_committed_unchanged(before, after)` checks the history half of I1; `check_unchanged`
is I5 (a refused call changed nothing); `check_no_quick_reuse(snapshot, reach)` is the design's
"no quick reuse" rule (R1). Each returns a list of violations, empty when all hold.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

from .model import Alert, Attempt, Checkpoint, Lease, Quarantine, Sink
from .states import (
    ABORT_PENDING_STATES,
    LOST_LEASE_STATES,
    UNRESOLVED_LEASE_STATES,
    AttemptState,
    CheckpointState,
    LeaseState,
)


@dataclass(frozen=True)
class Snapshot:
    sinks: list[Sink] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    quarantines: list[Quarantine] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)  # data_lost / lost_data_acknowledged events


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


def check_invariants(s: Snapshot, *, settled: bool = False) -> list[Violation]:
    """`settled=True` additionally requires every loser to have ended ABORTED (no abort pending)."""
    return [*_i1_structure(s), *_i2(s, settled), *_i3(s), *_i4(s), *_fencing(s), *_l1(s)]


def _attempts_by_checkpoint(s: Snapshot) -> dict[int, dict[int, Attempt]]:
    out: dict[int, dict[int, Attempt]] = defaultdict(dict)
    for a in s.attempts:
        out[a.checkpoint_id][a.number] = a
    return out


def _i1_structure(s: Snapshot) -> list[Violation]:
    out = []
    attempts = _attempts_by_checkpoint(s)
    for c in s.checkpoints:
        if c.history_pruned_at is not None:  # an old batch's history pruned: only its row is left
            if c.state is not CheckpointState.COMMITTED or attempts[c.id]:
                out.append(Violation("I1", f"checkpoint {c.id} is {c.state} with {len(attempts[c.id])} attempt(s) "
                                           "but marked pruned"))
            continue
        committed = [
            a for a in attempts[c.id].values()
            if a.state in (AttemptState.COMMITTED, AttemptState.COMMITTING, AttemptState.LOST)
        ]
        if len(committed) > 1:
            out.append(Violation("I1", f"checkpoint {c.id} has {len(committed)} decided attempts"))
        if c.state is CheckpointState.COMMITTED:
            a = attempts[c.id].get(c.committed_attempt or -1)
            if a is None or a.state is not AttemptState.COMMITTED:
                out.append(Violation("I1", f"checkpoint {c.id} COMMITTED but attempt {c.committed_attempt} is not"))
        if c.state is CheckpointState.LOST:
            a = attempts[c.id].get(c.committed_attempt or -1)
            if a is None or a.state is not AttemptState.LOST:
                out.append(Violation("I1", f"checkpoint {c.id} LOST but its decided attempt {c.committed_attempt} is not"))
        if c.state is CheckpointState.OPEN and committed:
            out.append(Violation("I1", f"checkpoint {c.id} OPEN with a decided attempt"))
    return out


def _i2(s: Snapshot, settled: bool) -> list[Violation]:
    out = []
    attempts = _attempts_by_checkpoint(s)
    leases_by_checkpoint: dict[int, list[Lease]] = defaultdict(list)
    for lease in s.leases:
        leases_by_checkpoint[lease.checkpoint_id].append(lease)
    for c in s.checkpoints:
        leases = leases_by_checkpoint[c.id]
        won = [lease for lease in leases if lease.state in (LeaseState.COMMITTED, LeaseState.COMMITTING)]
        if c.state is CheckpointState.OPEN:
            if won:
                out.append(Violation("I2", f"open checkpoint {c.id} has committed leases {[w.id for w in won]}"))
            continue
        decided = attempts[c.id].get(c.committed_attempt or -1)
        lost = [lease for lease in leases if lease.state in LOST_LEASE_STATES]
        if lost and c.state is not CheckpointState.LOST:
            out.append(Violation("I2", f"checkpoint {c.id} is {c.state} but leases {[x.id for x in lost]} were lost"))
        if c.state is CheckpointState.LOST and not lost:
            out.append(Violation("I2", f"checkpoint {c.id} is LOST but no winner was refused"))
        per_partition: dict[int, int] = defaultdict(int)
        for x in lost:  # a refused winner still counts as its partition's one decided transaction
            if decided is None or x.attempt_id != decided.id:
                out.append(Violation("I2", f"lease {x.id} lost outside the decided attempt of checkpoint {c.id}"))
            per_partition[x.partition] += 1
        for w in won:
            if decided is None or w.attempt_id != decided.id:
                out.append(Violation("I2", f"lease {w.id} committed outside the decided attempt of checkpoint {c.id}"))
            per_partition[w.partition] += 1
            if not w.records:
                out.append(Violation("I2", f"lease {w.id} committed with no records"))
        for partition, n in per_partition.items():
            if n != 1:
                out.append(Violation("I2", f"checkpoint {c.id} partition {partition} has {n} committed transactions"))
        if c.state in (CheckpointState.COMMITTED, CheckpointState.LOST):
            if c.state is CheckpointState.COMMITTED and any(w.state is LeaseState.COMMITTING for w in won):
                out.append(Violation("I2", f"checkpoint {c.id} COMMITTED with a winner still COMMITTING"))
            if decided is not None and decided.partitions is not None:
                if any(p >= decided.partitions for p in per_partition):
                    out.append(Violation("I2", f"checkpoint {c.id} committed a partition beyond its count"))
            bad = [
                lease.id for lease in leases
                if lease not in won
                and lease.state not in (LeaseState.ABORTED, LeaseState.LOST)
                and (settled or lease.state not in ABORT_PENDING_STATES)
            ]
            if bad:
                out.append(Violation("I2", f"checkpoint {c.id} committed but non-winner leases {bad} are not aborted"))
    return out


_NEVER = datetime.max.replace(tzinfo=timezone.utc)


def _in_lease_order(x: Lease) -> tuple[datetime, datetime, int]:
    """An id's leases in the order they held it: by the time each took it from the pool; at the
    same instant (a manual clock), the one resolved first, then by id."""
    return x.taken_at, x.resolved_at or _NEVER, x.id


def _i3(s: Snapshot) -> list[Violation]:
    """No id is held by two unresolved leases, and an id's leases follow one another: each was
    resolved before the next one took the id."""
    out = []
    holders: dict[tuple[int, int], list[Lease]] = defaultdict(list)
    history: dict[tuple[int, int], list[Lease]] = defaultdict(list)
    for lease in s.leases:
        history[lease.sink_id, lease.ordinal].append(lease)
        if lease.state in UNRESOLVED_LEASE_STATES:
            holders[lease.sink_id, lease.ordinal].append(lease)
        if (lease.resolved_at is None) != (lease.state in UNRESOLVED_LEASE_STATES):
            out.append(Violation("I3", f"lease {lease.id} is {lease.state} with resolved_at {lease.resolved_at}"))
    for held in holders.values():
        if len(held) > 1:
            out.append(Violation("I3", f"{held[0].transactional_id} is held by {len(held)} unresolved leases "
                                       f"{[h.id for h in held]}"))
    for leases in history.values():
        leases.sort(key=_in_lease_order)
        for earlier, later in zip(leases, leases[1:]):
            if earlier.resolved_at is None or earlier.resolved_at > later.taken_at:
                out.append(Violation("I3", f"{later.transactional_id} leased to {later.id} before lease "
                                           f"{earlier.id} was resolved"))
    return out


def _i4(s: Snapshot) -> list[Violation]:
    out = []
    margin = {sink.id: sink.commit_margin_ms for sink in s.sinks}
    attempt_by_id = {a.id: a for a in s.attempts}
    for lease in s.leases:
        if lease.state not in (LeaseState.COMMITTING, LeaseState.COMMITTED, *LOST_LEASE_STATES):
            continue
        attempt = attempt_by_id[lease.attempt_id]
        if attempt.decided_at is None:
            out.append(Violation("I4", f"winner lease {lease.id} has no decision time"))
            continue
        if attempt.decided_at + timedelta(milliseconds=margin[lease.sink_id]) > lease.deadline_at:
            out.append(Violation("I4", f"lease {lease.id} was decided within the margin of its deadline"))
    return out


def _fencing(s: Snapshot) -> list[Violation]:
    """F1: starting a generation aborts every open attempt of older ones, and begin serialises with
    it, so no attempt of a fenced generation is still open. F2: a retired sink holds nothing open
    (no recovery loop looks at it again): no open attempt, no unresolved lease."""
    out = []
    sinks = {x.id: x for x in s.sinks}
    checkpoint_sink = {c.id: c.sink_id for c in s.checkpoints}
    for a in s.attempts:
        sink = sinks.get(checkpoint_sink.get(a.checkpoint_id, -1))
        if sink is None or a.state is not AttemptState.OPEN:
            continue
        if a.generation < sink.generation:
            out.append(Violation("F1", f"attempt {a.id} of fenced generation {a.generation} is open (sink "
                                       f"{sink.name} is at generation {sink.generation})"))
        if sink.retired_at is not None:
            out.append(Violation("F2", f"retired sink {sink.name} has an open attempt {a.id}"))
    for x in s.leases:
        sink = sinks.get(x.sink_id)
        if sink is not None and sink.retired_at is not None and x.state in UNRESOLVED_LEASE_STATES:
            out.append(Violation("F2", f"retired sink {sink.name} still holds {x.transactional_id} (lease {x.id}, "
                                       f"{x.state})"))
    return out


def _l1(s: Snapshot) -> list[Violation]:
    """Lost data is loud: a LOST checkpoint has a data_lost alert, and the sink stays halted from
    its latest data_lost alert until an acknowledgement that came after it."""
    out = []
    lost_alerts = {a.checkpoint_id for a in s.alerts if a.kind == "data_lost"}
    for c in s.checkpoints:
        if c.state is CheckpointState.LOST and c.id not in lost_alerts:
            out.append(Violation("L1", f"checkpoint {c.id} is LOST without a data_lost alert"))
    for sink in s.sinks:
        mine = sorted((a for a in s.alerts if a.sink_id == sink.id), key=lambda a: a.id)
        if mine and mine[-1].kind == "data_lost" and sink.halted_at is None:
            out.append(Violation("L1", f"sink {sink.name} lost data (alert {mine[-1].id}) and is not halted, "
                                       "yet nobody acknowledged it"))
    return out


def check_no_quick_reuse(s: Snapshot, reach: timedelta) -> list[Violation]:
    """R1: an id is leased again only after every earlier try on it that may still act on Kafka
    is past `reach` (lease age bound at init + init timeout + request timeout: how late a stalled
    try's InitProducerId or request can land). Exempt: a committed winner (its try reported and its
    transaction ended) and a pre-lease no try ever claimed (no producer was ever made on it)."""

    def may_act_late(x: Lease) -> bool:
        return x.state is not LeaseState.COMMITTED and x.task_attempt_id is not None

    out = []
    by_id: dict[tuple[int, int], list[Lease]] = defaultdict(list)
    for x in s.leases:
        by_id[x.sink_id, x.ordinal].append(x)
    for history in by_id.values():
        history.sort(key=_in_lease_order)
        for earlier, later in zip(history, history[1:]):
            if may_act_late(earlier) and later.taken_at < earlier.leased_at + reach:
                out.append(Violation("R1", f"{later.transactional_id} taken again (lease {later.id}) "
                                           f"{(later.taken_at - earlier.leased_at).total_seconds():.3f} s after "
                                           f"lease {earlier.id} ({earlier.state}), whose try may act for "
                                           f"{reach.total_seconds():.3f} s"))
    return out


def check_committed_unchanged(before: Snapshot, after: Snapshot) -> list[Violation]:
    """I1, history half: a COMMITTED checkpoint and its leases never change afterwards, except
    that an old one's history may be pruned (its row marked, its leases gone)."""
    out = []
    after_cp = {c.id: c for c in after.checkpoints}
    after_leases = {lease.id: lease for lease in after.leases}
    committed = {c.id for c in before.checkpoints if c.state is CheckpointState.COMMITTED}
    pruned = {c.id for c in after.checkpoints if c.history_pruned_at is not None}
    for c in before.checkpoints:
        later = after_cp.get(c.id)
        if c.id in pruned and later is not None and replace(later, history_pruned_at=c.history_pruned_at) == c:
            continue
        if c.id in committed and later != c:
            out.append(Violation("I1", f"committed checkpoint {c.id} changed: {c} -> {later}"))
    for lease in before.leases:
        if lease.checkpoint_id in committed and lease.state is LeaseState.COMMITTED:
            if lease.checkpoint_id in pruned and lease.id not in after_leases:
                continue
            if after_leases.get(lease.id) != lease:
                out.append(Violation("I1", f"committed lease {lease.id} changed"))
    return out


def check_unchanged(before: Snapshot, after: Snapshot) -> list[Violation]:
    """I5: a refused (stale) call must leave the durable state exactly as it was."""
    if before == after:
        return []
    diffs = [
        name for name in ("sinks", "checkpoints", "attempts", "leases", "quarantines", "alerts")
        if getattr(before, name) != getattr(after, name)
    ]
    return [Violation("I5", f"a refused call changed {', '.join(diffs)}")]
