"""The coordinator's reads: sinks, checkpoints, events, open transactions, pool usage, the
invariant snapshot (the API, the dashboard, the CLI, the recovery sweep and the tests use them).
They change nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..protocol import recovery_rules
from ..protocol.invariants import Snapshot
from ..protocol.model import Checkpoint, Lease, Sink
from ..protocol.states import MAY_HOLD_TRANSACTION, CheckpointState, LeaseState
from ..store import batches, events, leases, pool, reads, sinks
from ..store.snapshot import snapshot
from .context import ServiceContext
from .results import BatchSummary, CheckpointDetail, LeasePage, OpenTransactions, PoolUsage, SinkOverview


class Reads:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def list_sinks(self) -> list[Sink]:
        return self.ctx.read(sinks.live_sinks)

    def get_sink(self, name: str, *, retired: bool = False) -> Sink:
        return self.ctx.read(lambda conn: sinks.sink_by_name(conn, name, retired=retired))

    def list_checkpoints(self, name: str, *, state: CheckpointState | None = None, before_batch: int | None = None,
                         limit: int = 50) -> list[Checkpoint]:
        return self.ctx.read(lambda conn: reads.checkpoints_of(conn, sinks.sink_by_name(conn, name), state=state,
                                                               before_batch=before_batch, limit=limit))

    def checkpoint_detail(self, name: str, batch_id: int) -> CheckpointDetail:
        """The checkpoint, its attempts and every lease (a page of them: checkpoint_leases)."""

        def read(conn: Any) -> CheckpointDetail:
            cp = batches.checkpoint_for(conn, sinks.sink_by_name(conn, name), batch_id)
            return CheckpointDetail(cp, batches.attempts_of(conn, [cp.id]), leases.of_checkpoints(conn, [cp.id]))

        return self.ctx.read(read)

    def possibly_open_transactions(self, name: str) -> list[Lease]:
        """Every lease whose transactional id may hold an unresolved transaction on the broker (a
        pre-lease no try claimed holds its id, but no transaction)."""
        return self.ctx.read(lambda conn: leases.unresolved(conn, sinks.sink_by_name(conn, name).id, MAY_HOLD_TRANSACTION))

    def open_transactions_in_brief(self, name: str, oldest: int) -> OpenTransactions:
        """How many of the sink's ids may hold an open transaction, the `oldest` of their leases
        (the nearest their timeout) and those the near-timeout rule reads."""

        def read(conn: Any) -> OpenTransactions:
            sink = sinks.sink_by_name(conn, name)
            return OpenTransactions(leases.count_unresolved(conn, sink.id, MAY_HOLD_TRANSACTION),
                                    reads.oldest_unresolved(conn, sink.id, oldest),
                                    leases.unresolved(conn, sink.id, recovery_rules.NEAR_TIMEOUT_STATES))

        return self.ctx.read(read)

    def list_events(self, name: str, *, after_id: int = 0, batch_id: int | None = None,
                    limit: int = 100) -> list[dict[str, Any]]:
        def read(conn: Any) -> list[dict[str, Any]]:
            sink = sinks.sink_by_name(conn, name, retired=True)  # a retired sink's trail stays readable
            cp_id = batches.checkpoint_for(conn, sink, batch_id).id if batch_id is not None else None
            return events.page(conn, sink.id, after_id=after_id, checkpoint_id=cp_id, limit=limit)

        return self.ctx.read(read)

    def recent_events(self, name: str, limit: int = 30) -> list[dict[str, Any]]:
        """The sink's newest events, newest first (list_events pages oldest first)."""
        return self.ctx.read(lambda conn: events.page(conn, sinks.sink_by_name(conn, name, retired=True).id,
                                                      limit=limit, newest_first=True))

    def checkpoint_history(self, name: str, limit: int = 50,
                           known_totals: Mapping[int, tuple[int, int]] | None = None) -> list[BatchSummary]:
        """The newest `limit` checkpoints of the sink's current lineage, newest first, with their
        attempts and what their winners wrote. `known_totals`: (records, bytes) by decided attempt
        id, from an earlier call (summing a wide batch's thousands of leases is the costly part)."""
        return self.ctx.read(lambda conn: reads.summaries(
            conn, reads.checkpoints_of(conn, sinks.sink_by_name(conn, name), limit=limit), known_totals))

    def batch_summary(self, name: str, batch_id: int) -> BatchSummary:
        return self.ctx.read(lambda conn: reads.summaries(
            conn, [batches.checkpoint_for(conn, sinks.sink_by_name(conn, name), batch_id)])[0])

    def checkpoint_leases(self, name: str, batch_id: int, *, state: LeaseState | None = None, after_id: int = 0,
                          limit: int = 200) -> LeasePage:
        return self.ctx.read(lambda conn: reads.lease_page(
            conn, batches.checkpoint_for(conn, sinks.sink_by_name(conn, name), batch_id).id, state=state,
            after_id=after_id, limit=limit))

    def sink_overviews(self, recent: int = 5) -> list[SinkOverview]:
        """Every live sink, by name, with its newest checkpoints and their attempts, its newest
        committed checkpoint and its possibly open transactions (a few statements in all)."""

        def read(conn: Any) -> list[SinkOverview]:
            seen = reads.sinks_recent(conn, recent)
            counts = reads.open_counts(conn)
            candidates = leases.unresolved(conn, None, recovery_rules.NEAR_TIMEOUT_STATES)
            return [SinkOverview(sink=s, recent=seen.recent.get(s.id, []), last_committed=seen.last_committed.get(s.id),
                                 open_transactions=counts.get(s.id, 0),
                                 near_timeout_candidates=[x for x in candidates if x.sink_id == s.id])
                    for s in seen.sinks]

        return self.ctx.read(read)

    def pool_usage(self, name: str) -> PoolUsage:
        def read(conn: Any) -> PoolUsage:
            sink = sinks.sink_by_name(conn, name)
            return PoolUsage(size=pool.read(conn, sink.id).size, leased=leases.count_unresolved(conn, sink.id),
                             max_size=sink.max_pool_size)

        return self.ctx.read(read)

    def snapshot(self) -> Snapshot:
        return self.ctx.read(snapshot)
