"""The coordinator's reads: sinks, checkpoints, events, open transactions, pool usage, the
invariant snapshot (the API, the dashboard, the CLI, the recovery sweep and the tests use them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, and_, func, select, true

from ..protocol import recovery_rules
from ..protocol.invariants import Snapshot
from ..protocol.model import Checkpoint, Lease, Sink
from ..protocol.states import UNRESOLVED_LEASE_STATES, WINNING_LEASE_STATES, CheckpointState, LeaseState
from ..store import repo
from ..store.tables import attempt_columns, attempts, checkpoints, events, leases, sinks, transactional_ids, unresolved_leases
from .base import CoordinatorBase
from .results import BatchSummary, CheckpointDetail, LeasePage, OpenTransactions, PoolUsage, SinkOverview


class Reads(CoordinatorBase):
    """Reads of the durable state; they change nothing."""

    def list_sinks(self) -> list[Sink]:
        with self.engine.connect() as conn:
            return [repo.sink_by_name(conn, n) for n in conn.execute(
                select(sinks.c.name).where(sinks.c.retired_at.is_(None)).order_by(sinks.c.name)).scalars()]

    def get_sink(self, name: str) -> Sink:
        with self.engine.connect() as conn:
            return repo.sink_by_name(conn, name)

    def list_checkpoints(
        self, name: str, *, state: CheckpointState | None = None, before_batch: int | None = None, limit: int = 50
    ) -> list[Checkpoint]:
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            stmt = select(checkpoints).where(
                checkpoints.c.sink_id == sink.id, checkpoints.c.query_id == sink.lineage_query_id
            )
            if state is not None:
                stmt = stmt.where(checkpoints.c.state == state.value)
            if before_batch is not None:
                stmt = stmt.where(checkpoints.c.batch_id < before_batch)
            rows = conn.execute(stmt.order_by(checkpoints.c.batch_id.desc()).limit(limit))
            return [repo.as_checkpoint(r) for r in rows]

    def checkpoint_detail(self, name: str, batch_id: int) -> CheckpointDetail:
        """The checkpoint, its attempts and every lease (a page of them: checkpoint_leases)."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cp = repo.checkpoint_for(conn, sink, batch_id)
            return CheckpointDetail(
                checkpoint=cp,
                attempts=repo.attempts_of_checkpoint(conn, cp.id),
                leases=repo.leases_where(conn, leases.c.checkpoint_id == cp.id),
            )

    def possibly_open_transactions(self, name: str) -> list[Lease]:
        """Every lease whose transactional id may hold an unresolved transaction on the broker."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            return repo.leases_where(
                conn, unresolved_leases.c.sink_id == sink.id, repo.unresolved_in(*UNRESOLVED_LEASE_STATES),
                source=unresolved_leases,
            )

    def open_transactions_in_brief(self, name: str, oldest: int) -> OpenTransactions:
        """How many of the sink's transactional ids may hold an open transaction, the `oldest` of
        their leases (the nearest their timeout) and those the near-timeout rule reads: a sink
        page's, without loading the thousands of first tries of a wide batch in flight."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            mine = (unresolved_leases.c.sink_id == sink.id, repo.unresolved_in(*UNRESOLVED_LEASE_STATES))
            count = conn.execute(select(func.count()).select_from(unresolved_leases).where(*mine)).scalar_one()
            shown = [repo.as_lease(r) for r in conn.execute(
                select(unresolved_leases).where(*mine)
                .order_by(unresolved_leases.c.leased_at, unresolved_leases.c.id).limit(oldest))]
            candidates = repo.leases_where(conn, unresolved_leases.c.sink_id == sink.id,
                                           repo.unresolved_in(*recovery_rules.NEAR_TIMEOUT_STATES),
                                           source=unresolved_leases)
        return OpenTransactions(count, shown, candidates)

    def list_events(
        self, name: str, *, after_id: int = 0, batch_id: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name, retired=True)  # a retired sink's trail stays readable
            stmt = select(events, checkpoints.c.batch_id).outerjoin(checkpoints, events.c.checkpoint_id == checkpoints.c.id)
            stmt = stmt.where(events.c.sink_id == sink.id, events.c.id > after_id)
            if batch_id is not None:
                stmt = stmt.where(events.c.checkpoint_id == repo.checkpoint_for(conn, sink, batch_id).id)
            return [dict(r._mapping) for r in conn.execute(stmt.order_by(events.c.id).limit(limit))]

    def recent_events(self, name: str, limit: int = 30) -> list[dict[str, Any]]:
        """The sink's newest events, newest first (list_events pages oldest first)."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name, retired=True)  # a retired sink's trail stays readable
            stmt = select(events, checkpoints.c.batch_id).outerjoin(checkpoints, events.c.checkpoint_id == checkpoints.c.id)
            stmt = stmt.where(events.c.sink_id == sink.id).order_by(events.c.id.desc()).limit(limit)
            return [dict(r._mapping) for r in conn.execute(stmt)]

    def checkpoint_history(
        self, name: str, limit: int = 50, known_totals: Mapping[int, tuple[int, int]] | None = None
    ) -> list[BatchSummary]:
        """The newest `limit` checkpoints of the sink's current lineage, newest first, with their
        attempts and what their winners wrote, in three queries (the dashboard's charts and tables).
        `known_totals`: (records, bytes) by decided attempt id, from an earlier call; a decided
        attempt's never change, and summing a wide batch's thousands of leases is the costly part."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            cps = [repo.as_checkpoint(r) for r in conn.execute(
                select(checkpoints)
                .where(checkpoints.c.sink_id == sink.id, checkpoints.c.query_id == sink.lineage_query_id)
                .order_by(checkpoints.c.batch_id.desc())
                .limit(limit)
            )]
            return _batch_summaries(conn, cps, known_totals or {})

    def batch_summary(self, name: str, batch_id: int) -> BatchSummary:
        with self.engine.connect() as conn:
            return _batch_summaries(conn, [repo.checkpoint_for(conn, repo.sink_by_name(conn, name), batch_id)], {})[0]

    def checkpoint_leases(
        self, name: str, batch_id: int, *, state: LeaseState | None = None, after_id: int = 0, limit: int = 200
    ) -> LeasePage:
        """The checkpoint's leases (of `state`, if given) after lease id `after_id`, at most `limit`,
        and its lease count by state."""
        with self.engine.connect() as conn:
            cp = repo.checkpoint_for(conn, repo.sink_by_name(conn, name), batch_id)
            counts = {LeaseState(s): n for s, n in conn.execute(
                select(leases.c.state, func.count()).where(leases.c.checkpoint_id == cp.id).group_by(leases.c.state))}
            conditions = [leases.c.checkpoint_id == cp.id, leases.c.id > after_id]
            if state is not None:
                conditions.append(leases.c.state == state.value)
            stmt = select(leases).where(*conditions).order_by(leases.c.id).limit(limit + 1)
            page = [repo.as_lease(r) for r in conn.execute(stmt)]
            return LeasePage(page[:limit], counts, more=len(page) > limit)

    def sink_overviews(self, recent: int = 5) -> list[SinkOverview]:
        """Every sink, by name, with its newest `recent` checkpoints of the current lineage and
        their attempts, its newest committed checkpoint and its possibly open transactions: five
        queries whatever the number of sinks (the dashboard's overview refreshes every few seconds).
        The per-sink parts are LATERAL subqueries, so each walks its sink's index from the newest
        batch instead of ranking the whole history."""
        lineage = and_(checkpoints.c.sink_id == sinks.c.id, checkpoints.c.query_id == sinks.c.lineage_query_id)
        newest = select(checkpoints).where(lineage).order_by(checkpoints.c.batch_id.desc())
        recent_cps = newest.limit(recent).lateral("recent_cps")
        committed = newest.where(checkpoints.c.state == CheckpointState.COMMITTED.value).limit(1).lateral("committed")
        with self.engine.connect() as conn:
            all_sinks = [Sink.from_mapping(r._mapping) for r in conn.execute(
                select(sinks).where(sinks.c.retired_at.is_(None)).order_by(sinks.c.name))]
            cps = [repo.as_checkpoint(r) for r in conn.execute(
                select(recent_cps).select_from(sinks.join(recent_cps, true()))
                .order_by(recent_cps.c.sink_id, recent_cps.c.batch_id.desc())
            )]
            last = {r.sink_id: repo.as_checkpoint(r) for r in conn.execute(
                select(committed).select_from(sinks.join(committed, true()))
            )}
            ids = [c.id for c in cps]
            cp_attempts = [repo.as_attempt(r) for r in conn.execute(
                select(*attempt_columns).where(attempts.c.checkpoint_id.in_(ids)).order_by(attempts.c.number)
            )] if ids else []
            # counted, and only the leases the health rules read loaded: a wide batch in flight
            # has thousands of LEASED first tries
            open_counts: dict[int, int] = dict(conn.execute(  # type: ignore[arg-type]
                select(unresolved_leases.c.sink_id, func.count())
                .where(repo.unresolved_in(*UNRESOLVED_LEASE_STATES)).group_by(unresolved_leases.c.sink_id)
            ).all())
            candidates = repo.leases_where(conn, repo.unresolved_in(*recovery_rules.NEAR_TIMEOUT_STATES),
                                           source=unresolved_leases)
        candidates_of: dict[int, list[Lease]] = {}
        for x in candidates:
            candidates_of.setdefault(x.sink_id, []).append(x)
        return [
            SinkOverview(
                sink=sink,
                recent=[(c, [a for a in cp_attempts if a.checkpoint_id == c.id]) for c in cps if c.sink_id == sink.id],
                last_committed=last.get(sink.id),
                open_transactions=open_counts.get(sink.id, 0),
                near_timeout_candidates=candidates_of.get(sink.id, []),
            )
            for sink in all_sinks
        ]

    def pool_usage(self, name: str) -> PoolUsage:
        """How many of the sink's pooled transactional ids exist and how many are leased."""
        with self.engine.connect() as conn:
            sink = repo.sink_by_name(conn, name)
            rows = conn.execute(
                select(transactional_ids.c.state, func.count())
                .where(transactional_ids.c.sink_id == sink.id)
                .group_by(transactional_ids.c.state)
            ).all()
        counts = {state: n for state, n in rows}
        return PoolUsage(size=sum(counts.values()), leased=counts.get("LEASED", 0), max_size=sink.max_pool_size)

    def snapshot(self) -> Snapshot:
        with self.engine.connect() as conn:
            return repo.snapshot(conn)


def _batch_summaries(
    conn: Connection, cps: list[Checkpoint], known: Mapping[int, tuple[int, int]]
) -> list[BatchSummary]:
    """The checkpoints with their attempts and their decided attempts' winners' sums (those not
    `known`): two queries whatever the number of leases (the sums are Postgres' work)."""
    ids = [c.id for c in cps]
    cp_attempts = [repo.as_attempt(r) for r in conn.execute(
        select(*attempt_columns).where(attempts.c.checkpoint_id.in_(ids)).order_by(attempts.c.number)
    )] if ids else []
    decided = {c.id: c.committed_attempt for c in cps if c.committed_attempt is not None}
    decided_ids = [a.id for a in cp_attempts if decided.get(a.checkpoint_id) == a.number and a.id not in known]
    summed = {r.attempt_id: (int(r.records), int(r.bytes)) for r in conn.execute(
        select(leases.c.attempt_id, func.coalesce(func.sum(leases.c.records), 0).label("records"),
               func.coalesce(func.sum(leases.c.bytes), 0).label("bytes"))
        .where(leases.c.attempt_id.in_(decided_ids), leases.c.state.in_([s.value for s in WINNING_LEASE_STATES]))
        .group_by(leases.c.attempt_id)
    )} if decided_ids else {}
    out = []
    for c in cps:
        mine = [a for a in cp_attempts if a.checkpoint_id == c.id]
        winner = next((a for a in mine if a.number == c.committed_attempt), None)
        records, size = (None, None) if winner is None else known.get(winner.id) or summed.get(winner.id, (0, 0))
        out.append(BatchSummary(c, mine, records, size))
    return out
