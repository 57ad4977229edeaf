"""The reads behind the API's listings, the dashboard and the CLI: a sink's batches with their
attempts and what their winners wrote, a page of a batch's leases, every sink at a glance. Each is
a few statements whatever the number of sinks, batches or leases (the sums are Postgres' work)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, and_, func, select, true

from ..protocol.model import Attempt, Checkpoint, Lease, Sink
from ..protocol.states import MAY_HOLD_TRANSACTION, WINNING_LEASE_STATES, CheckpointState, LeaseState
from . import batches
from .tables import checkpoints, leases, sinks


def checkpoints_of(conn: Connection, sink: Sink, *, state: CheckpointState | None = None,
                   before_batch: int | None = None, limit: int = 50) -> list[Checkpoint]:
    """The sink's batches of its current lineage, newest first."""
    stmt = select(checkpoints).where(checkpoints.c.sink_id == sink.id,
                                     checkpoints.c.query_id == (sink.lineage_query_id or ""))
    if state is not None:
        stmt = stmt.where(checkpoints.c.state == state.value)
    if before_batch is not None:
        stmt = stmt.where(checkpoints.c.batch_id < before_batch)
    return [Checkpoint.from_mapping(r._mapping)
            for r in conn.execute(stmt.order_by(checkpoints.c.batch_id.desc()).limit(limit))]


@dataclass(frozen=True)
class BatchSummary:
    """A checkpoint, its attempts and what its decided attempt's winners wrote (summed by
    Postgres: a batch may have thousands of leases)."""

    checkpoint: Checkpoint
    attempts: list[Attempt]
    records: int | None  # None until a commit is decided
    bytes: int | None

    @property
    def decided_attempt(self) -> Attempt | None:
        return next((a for a in self.attempts if a.number == self.checkpoint.committed_attempt), None)


def summaries(conn: Connection, cps: Sequence[Checkpoint], known: Mapping[int, tuple[int, int]] | None = None
              ) -> list[BatchSummary]:
    """The checkpoints with their attempts and the sums of their decided attempts' winners (those
    not `known`, by attempt id: a decided attempt's sums never change)."""
    known = known or {}
    cp_attempts = batches.attempts_of(conn, [c.id for c in cps])
    decided = {c.id: c.committed_attempt for c in cps if c.committed_attempt is not None}
    to_sum = [a.id for a in cp_attempts if decided.get(a.checkpoint_id) == a.number and a.id not in known]
    summed = {r.attempt_id: (int(r.records), int(r.bytes)) for r in conn.execute(
        select(leases.c.attempt_id, func.coalesce(func.sum(leases.c.records), 0).label("records"),
               func.coalesce(func.sum(leases.c.bytes), 0).label("bytes"))
        .where(leases.c.attempt_id.in_(to_sum), leases.c.state.in_([s.value for s in WINNING_LEASE_STATES]))
        .group_by(leases.c.attempt_id)
    )} if to_sum else {}
    out = []
    for c in cps:
        mine = [a for a in cp_attempts if a.checkpoint_id == c.id]
        winner = next((a for a in mine if a.number == c.committed_attempt), None)
        records, size = (None, None) if winner is None else known.get(winner.id) or summed.get(winner.id, (0, 0))
        out.append(BatchSummary(c, mine, records, size))
    return out


@dataclass(frozen=True)
class LeasePage:
    """Some of a checkpoint's leases, by id, and how many it has in each state."""

    leases: list[Lease]
    by_state: dict[LeaseState, int]
    more: bool  # leases of the state asked for follow the last one listed


def lease_page(conn: Connection, checkpoint_id: int, *, state: LeaseState | None = None, after_id: int = 0,
               limit: int = 200) -> LeasePage:
    counts = {LeaseState(s): n for s, n in conn.execute(
        select(leases.c.state, func.count()).where(leases.c.checkpoint_id == checkpoint_id).group_by(leases.c.state))}
    stmt = select(leases).where(leases.c.checkpoint_id == checkpoint_id, leases.c.id > after_id)
    if state is not None:
        stmt = stmt.where(leases.c.state == state.value)
    page = [Lease.from_mapping(r._mapping) for r in conn.execute(stmt.order_by(leases.c.id).limit(limit + 1))]
    return LeasePage(page[:limit], counts, more=len(page) > limit)


_MAY_HOLD = [s.value for s in MAY_HOLD_TRANSACTION]


def open_counts(conn: Connection) -> dict[int, int]:
    """Leases whose transaction may be open, by sink id."""
    return dict(conn.execute(select(leases.c.sink_id, func.count()).where(
        leases.c.resolved_at.is_(None), leases.c.state.in_(_MAY_HOLD)).group_by(leases.c.sink_id)).all())  # type: ignore[arg-type]


def oldest_unresolved(conn: Connection, sink_id: int, limit: int) -> list[Lease]:
    """The sink's leases whose transaction may be open, the oldest first."""
    return [Lease.from_mapping(r._mapping) for r in conn.execute(
        select(leases).where(leases.c.sink_id == sink_id, leases.c.resolved_at.is_(None), leases.c.state.in_(_MAY_HOLD))
        .order_by(leases.c.leased_at, leases.c.id).limit(limit))]


@dataclass(frozen=True)
class SinkRecent:
    """Every live sink with its newest batches (and their attempts) and its newest committed one."""

    sinks: list[Sink]
    recent: dict[int, list[tuple[Checkpoint, list[Attempt]]]]
    last_committed: dict[int, Checkpoint]


def sinks_recent(conn: Connection, recent: int) -> SinkRecent:
    """Three statements whatever the number of sinks: the per-sink parts are LATERAL subqueries,
    each walking its sink's index from the newest batch."""
    lineage = and_(checkpoints.c.sink_id == sinks.c.id, checkpoints.c.query_id == sinks.c.lineage_query_id)
    newest = select(checkpoints).where(lineage).order_by(checkpoints.c.batch_id.desc())
    recent_cps = newest.limit(recent).lateral("recent_cps")
    committed = newest.where(checkpoints.c.state == CheckpointState.COMMITTED.value).limit(1).lateral("committed")
    live = [Sink.from_mapping(r._mapping) for r in conn.execute(
        select(sinks).where(sinks.c.retired_at.is_(None)).order_by(sinks.c.name))]
    cps = [Checkpoint.from_mapping(r._mapping) for r in conn.execute(
        select(recent_cps).select_from(sinks.join(recent_cps, true()))
        .where(sinks.c.retired_at.is_(None)).order_by(recent_cps.c.sink_id, recent_cps.c.batch_id.desc()))]
    last = {r.sink_id: Checkpoint.from_mapping(r._mapping) for r in conn.execute(
        select(committed).select_from(sinks.join(committed, true())).where(sinks.c.retired_at.is_(None)))}
    attempts = batches.attempts_of(conn, [c.id for c in cps])
    by_sink: dict[int, list[tuple[Checkpoint, list[Attempt]]]] = {}
    for c in cps:
        by_sink.setdefault(c.sink_id, []).append((c, [a for a in attempts if a.checkpoint_id == c.id]))
    return SinkRecent(live, by_sink, last)
