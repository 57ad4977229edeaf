"""Pruning old batch history (admin, and the recovery loop with a retention set): the bulky record
of COMMITTED batches older than the retention -- their attempts, leases (with the pre-commit
records) and events -- is deleted, a chunk of batches per transaction.

What stays, so that pruning never changes what the protocol decides:
- every checkpoint row, marked `history_pruned_at`. A replay of a pruned batch id is skipped as
  committed, and a re-plan of it over other offsets is refused by its digest, as before;
- each query's newest COMMITTED batch, whole (the dashboard's "last committed");
- every batch that is not COMMITTED (open, committing, lost: lost data is evidence), and every
  committed one with a lease still unresolved (an abort pending on Kafka);
- the sink-level events (registration, generations, halts, retirement, sweeps): few, and the
  sink's audit trail.

The statements are store/history.py's."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from ..protocol import errors as e
from ..store import events, sinks
from ..store import history as store_history
from . import metrics
from .context import ServiceContext, log

MAX_CHUNK = 5_000


@dataclass(frozen=True)
class PruneOutcome:
    cutoff: datetime  # batches committed before this were prunable
    pruned: int  # batches whose history this call deleted (0 on a dry run)
    more: bool  # prunable batches are left (a dry run: whether there are any)
    candidates: int | None = None  # a dry run: how many batches a prune would take now
    attempts: int = 0
    leases: int = 0
    events: int = 0
    by_sink: dict[str, int] | None = None  # batches pruned (or prunable, on a dry run) by sink name

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def prune_history(ctx: ServiceContext, older_than: timedelta, actor: str, *, sink: str | None = None,
                  limit: int = 500, dry_run: bool = False) -> PruneOutcome:
    """Delete the history of up to `limit` COMMITTED batches committed more than `older_than` ago
    (every sink's, or `sink`'s), in one transaction. Call again while `more`."""
    youngest = timedelta(milliseconds=ctx.limits.history_min_retention_ms)
    if older_than < youngest:
        raise e.Invalid("invalid_prune", f"history younger than {youngest} is kept; older_than_s was "
                        f"{int(older_than.total_seconds())} ({older_than})", field="older_than_s")
    if not 1 <= limit <= MAX_CHUNK:
        raise e.Invalid("invalid_prune", f"limit must be 1..{MAX_CHUNK} batches per call, got limit={limit}", field="limit")

    def step(conn: Connection) -> PruneOutcome:
        sink_id = sinks.sink_by_name(conn, sink, retired=True).id if sink is not None else None
        now = ctx.clock.now_in(conn)
        cutoff = now - older_than
        names = sinks.names_by_id(conn)
        if dry_run:
            counts = store_history.prunable_counts(conn, cutoff, sink_id)
            total = sum(counts.values())
            return PruneOutcome(cutoff, 0, total > 0, candidates=total, by_sink={names[k]: n for k, n in counts.items()})
        chunk = store_history.lock_chunk(conn, cutoff, sink_id, limit + 1)
        more, chunk = len(chunk) > limit, chunk[:limit]
        if not chunk:
            return PruneOutcome(cutoff, 0, False, by_sink={})
        done = store_history.delete_chunk(conn, [cp_id for cp_id, _, _ in chunk], now)
        by_sink: dict[int, list[int]] = {}
        for _, owner, batch in chunk:
            by_sink.setdefault(owner, []).append(batch)
        for owner, batch_ids in by_sink.items():
            events.add(conn, owner, "history_pruned", actor, now, batches=len(batch_ids), first_batch_id=min(batch_ids),
                       last_batch_id=max(batch_ids), older_than_s=older_than.total_seconds())
        return PruneOutcome(cutoff, done.checkpoints, more, attempts=done.attempts, leases=done.leases,
                            events=done.events, by_sink={names[k]: len(v) for k, v in by_sink.items()})

    outcome = ctx.transaction(step)
    if not dry_run:
        for name, n in (outcome.by_sink or {}).items():
            metrics.HISTORY_PRUNED.labels(name).inc(n)
    if outcome.pruned:
        log.info("pruned the history of %d committed batch(es) older than %s (%s)%s", outcome.pruned,
                 outcome.cutoff.isoformat(), ", ".join(f"{k}: {v}" for k, v in (outcome.by_sink or {}).items()),
                 "; more to prune" if outcome.more else "")
    return outcome
