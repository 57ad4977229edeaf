"""Leases: one row per pooled transactional id held for a partition of an attempt. Reads, the
grant (a batch's pre-leases, or one try's id), the claim of a pre-lease, the decision's records,
and the compare-and-set moves of their states.

A lease holds its id while `resolved_at` is NULL (the partial unique index uq_leases_held makes
that I3 in the database). Statements over many leases pass them as arrays (`unnest`), so a
200-partition batch is one statement, whatever its width.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, text, update

from ..protocol.model import Lease, PrecommitRecord
from ..protocol.states import UNRESOLVED_LEASE_STATES, LeaseState, require_transition
from .tables import attempts, leases


def _leases(rows: Iterable[Any]) -> list[Lease]:
    return sorted((Lease.from_mapping(r._mapping) for r in rows), key=lambda x: x.id)


@dataclass(frozen=True)
class NewLease:
    """A lease to insert: its id from the pool, for one partition (and one try, or none yet)."""

    ordinal: int
    transactional_id: str
    partition: int
    task_attempt_id: int | None


def grant(conn: Connection, *, sink_id: int, checkpoint_id: int, attempt_id: int, new: Sequence[NewLease],
          now: datetime, deadline_at: datetime) -> list[Lease]:
    """Insert the leases (PRELEASED without a try, LEASED with one), in one statement."""
    if not new:
        return []
    rows = conn.execute(insert(leases).returning(*leases.c, sort_by_parameter_order=True), [
        dict(sink_id=sink_id, checkpoint_id=checkpoint_id, attempt_id=attempt_id, partition=x.partition,
             task_attempt_id=x.task_attempt_id, ordinal=x.ordinal, transactional_id=x.transactional_id,
             state=(LeaseState.PRELEASED if x.task_attempt_id is None else LeaseState.LEASED).value,
             taken_at=now, leased_at=now, deadline_at=deadline_at)
        for x in new
    ])
    return [Lease.from_mapping(r._mapping) for r in rows]


# built once: the protocol's calls run these for every batch and partition
_CLAIM = (update(leases).where(leases.c.id == bindparam("lease_id"), leases.c.state == LeaseState.PRELEASED.value)
          .values(state=LeaseState.LEASED.value).returning(*leases.c))
_OF_ATTEMPT = select(leases).where(leases.c.attempt_id == bindparam("attempt_id")).order_by(leases.c.id)
_OF_PARTITION = select(leases).where(leases.c.attempt_id == bindparam("attempt_id"),
                                     leases.c.partition == bindparam("partition_"))
_LOCKED = {stmt: stmt.with_for_update() for stmt in (_OF_ATTEMPT, _OF_PARTITION)}


def claim(conn: Connection, pre_lease: Lease, task_attempt_id: int, now: datetime, deadline_at: datetime) -> Lease | None:
    """The pre-lease held by this try from now on, if no try claimed it first (None otherwise)."""
    require_transition(pre_lease.state, LeaseState.LEASED)
    row = conn.execute(_CLAIM, dict(lease_id=pre_lease.id, task_attempt_id=task_attempt_id, leased_at=now,
                                    deadline_at=deadline_at)).first()
    return None if row is None else Lease.from_mapping(row._mapping)


def of_attempt(conn: Connection, attempt_id: int, *, lock: bool = False) -> list[Lease]:
    return _leases(conn.execute(_LOCKED[_OF_ATTEMPT] if lock else _OF_ATTEMPT, dict(attempt_id=attempt_id)))


def of_partition(conn: Connection, attempt_id: int, partition: int, *, lock: bool = False) -> list[Lease]:
    """The partition's pre-lease and the leases its tries hold."""
    return _leases(conn.execute(_LOCKED[_OF_PARTITION] if lock else _OF_PARTITION,
                                dict(attempt_id=attempt_id, partition_=partition)))


_OF_CHECKPOINTS = select(leases).where(leases.c.checkpoint_id.in_(bindparam("checkpoint_ids", expanding=True)))
_OF_CHECKPOINTS_IN = _OF_CHECKPOINTS.where(leases.c.state.in_(bindparam("states", expanding=True)))


def of_checkpoints(conn: Connection, checkpoint_ids: Sequence[int], states: Iterable[LeaseState] | None = None) -> list[Lease]:
    if not checkpoint_ids:
        return []
    if states is None:
        return _leases(conn.execute(_OF_CHECKPOINTS, dict(checkpoint_ids=list(checkpoint_ids))))
    return _leases(conn.execute(_OF_CHECKPOINTS_IN, dict(checkpoint_ids=list(checkpoint_ids),
                                                         states=[s.value for s in states])))


def by_ids(conn: Connection, ids: Sequence[int]) -> list[Lease]:
    return _leases(conn.execute(select(leases).where(leases.c.id.in_(list(ids))))) if ids else []


def unresolved(conn: Connection, sink_id: int | None = None, states: Iterable[LeaseState] | None = None,
               *, lock: bool = False) -> list[Lease]:
    """Leases whose id may hold an open transaction (every sink's, or one's), of `states` if given."""
    stmt = select(leases).where(leases.c.resolved_at.is_(None))
    if sink_id is not None:
        stmt = stmt.where(leases.c.sink_id == sink_id)
    if states is not None:
        stmt = stmt.where(leases.c.state.in_([s.value for s in states]))
    return _leases(conn.execute(stmt.with_for_update() if lock else stmt))


def of_attempts_aborted_for(conn: Connection, sink_id: int, reason: str) -> list[Lease]:
    """The leases tries held in the sink's attempts aborted for `reason` (a generation's fencing)."""
    aborted = select(attempts.c.id).where(attempts.c.sink_id == sink_id, attempts.c.abort_reason == reason)
    return _leases(conn.execute(select(leases).where(leases.c.attempt_id.in_(aborted),
                                                     leases.c.task_attempt_id.is_not(None))))


def of_producers(conn: Connection, sink_id: int, producer_ids: Sequence[int]) -> list[Lease]:
    return _leases(conn.execute(select(leases).where(leases.c.sink_id == sink_id,
                                                     leases.c.producer_id.in_(list(producer_ids)))))


def count_unresolved(conn: Connection, sink_id: int, states: Iterable[LeaseState] | None = None) -> int:
    stmt = select(func.count()).select_from(leases).where(leases.c.sink_id == sink_id, leases.c.resolved_at.is_(None))
    if states is not None:
        stmt = stmt.where(leases.c.state.in_([s.value for s in states]))
    return int(conn.execute(stmt).scalar_one())


def move(conn: Connection, ids: Iterable[int], old: Iterable[LeaseState], new: LeaseState, now: datetime,
         **values: Any) -> list[Lease]:
    """Compare-and-set: the leases among `ids` still in one of `old` move to `new` (resolved at
    `now` if `new` ends them); the moved ones, by id."""
    ids, old = list(ids), list(old)
    for state in old:
        require_transition(state, new)
    if not ids:
        return []
    if new not in UNRESOLVED_LEASE_STATES:
        values["resolved_at"] = now
    return _leases(conn.execute(_MOVE, dict(ids=ids, old_states=[s.value for s in old], state=new.value, **values)))


_MOVE = (update(leases).where(leases.c.id.in_(bindparam("ids", expanding=True)),
                              leases.c.state.in_(bindparam("old_states", expanding=True)))
         .returning(*leases.c))


_DECIDE_WINNERS = text("""
    UPDATE leases AS l
       SET state = 'COMMITTING', producer_id = r.producer_id, producer_epoch = r.producer_epoch,
           records = r.records, bytes = r.bytes, write_ms = r.write_ms, first_offsets = r.first_offsets
      FROM unnest(CAST(:ids AS bigint[]), CAST(:producer_ids AS bigint[]), CAST(:epochs AS int[]),
                  CAST(:records AS bigint[]), CAST(:bytes AS bigint[]), CAST(:write_ms AS bigint[]),
                  CAST(:first_offsets AS text[]))
           AS r(id, producer_id, producer_epoch, records, bytes, write_ms, first_offsets)
     WHERE l.id = r.id AND l.state = 'LEASED'
    RETURNING l.*
""")


def decide_winners(conn: Connection, winners: Sequence[tuple[Lease, PrecommitRecord]]) -> list[Lease]:
    """LEASED -> COMMITTING for each winner, with the pre-commit record its try reported, in one
    statement; the moved ones, by id."""
    require_transition(LeaseState.LEASED, LeaseState.COMMITTING)
    if not winners:
        return []
    records = [r for _, r in winners]
    rows = conn.execute(_DECIDE_WINNERS, dict(
        ids=[w.id for w, _ in winners],
        producer_ids=[r.producer_id for r in records],
        epochs=[r.producer_epoch for r in records],
        records=[r.records for r in records],
        bytes=[r.bytes for r in records],
        write_ms=[r.write_ms for r in records],
        first_offsets=[None if r.first_offsets is None else json.dumps([list(x) for x in r.first_offsets])
                       for r in records],
    ))
    return _leases(rows)
