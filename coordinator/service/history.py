"""Pruning old batch history (admin, and the recovery loop with a retention set): the bulky record
of COMMITTED batches older than the retention -- their attempts (the first tries' ids and
pre-commit records), lease rows and events -- is deleted, a chunk of batches per transaction.

What stays, so that pruning never changes what the protocol decides:
- every checkpoint row, marked `history_pruned_at`. A replay of a pruned batch id is skipped as
  committed, and a re-plan of it over other offsets is refused by its digest, as before;
- each query's newest COMMITTED batch, whole (the dashboard's "last committed");
- every batch that is not COMMITTED (open, committing, lost: lost data is evidence), and every
  committed one with a lease still unresolved (an abort pending on Kafka) or a transactional id
  that still names one of its leases;
- the sink-level events (registration, generations, halts, retirement, sweeps): few, and the
  sink's audit trail.

The chunk's checkpoints are locked (FOR UPDATE SKIP LOCKED) before anything of theirs is deleted,
so a concurrent begin, resume or read of one of them waits for the chunk and then sees it pruned.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, text

from ..protocol import errors as e
from ..store import repo
from ..store.tables import FIRST_TRY_ID_BASE, FIRST_TRY_ID_STRIDE
from . import metrics
from .base import CoordinatorBase, log

# The prunable COMMITTED checkpoints, oldest commit first (see the module's docstring for why
# each condition). `sink_id` NULL: every sink's. No condition reads the `leases` view: it would
# unpack every attempt's first tries for each checkpoint. An id names a first try by a lease id
# inside its attempt's block (tables.first_try_lease_id), found through the index on lease_id.
_PRUNABLE = f"""
    SELECT c.id, c.sink_id, c.batch_id FROM checkpoints AS c
    WHERE c.state = 'COMMITTED' AND c.history_pruned_at IS NULL AND c.committed_at < :cutoff
    AND (CAST(:sink_id AS bigint) IS NULL OR c.sink_id = :sink_id)
    AND c.batch_id < (SELECT max(n.batch_id) FROM checkpoints AS n
                      WHERE n.sink_id = c.sink_id AND n.query_id = c.query_id AND n.state = 'COMMITTED')
    AND NOT EXISTS (SELECT 1 FROM attempts AS a WHERE a.checkpoint_id = c.id AND a.finished_at IS NULL)
    AND NOT EXISTS (SELECT 1 FROM lease_rows AS l WHERE l.checkpoint_id = c.id
                    AND (l.resolved_at IS NULL OR EXISTS (SELECT 1 FROM transactional_ids AS t WHERE t.lease_id = l.id)))
    AND NOT EXISTS (SELECT 1 FROM attempts AS a JOIN transactional_ids AS t
                    ON t.lease_id BETWEEN {FIRST_TRY_ID_BASE} + a.id * {FIRST_TRY_ID_STRIDE}
                                      AND {FIRST_TRY_ID_BASE} + (a.id + 1) * {FIRST_TRY_ID_STRIDE} - 1
                    WHERE a.checkpoint_id = c.id AND a.first_tids IS NOT NULL)
"""

_CHUNK = text(f"""{_PRUNABLE}
    ORDER BY c.committed_at, c.id
    LIMIT :limit
    FOR UPDATE OF c SKIP LOCKED
""")

# one statement: the chunk's events, lease rows and attempts deleted, its checkpoints marked
_DELETE = text("""
WITH ev AS (DELETE FROM events WHERE checkpoint_id = ANY(:ids) RETURNING 1),
     lr AS (DELETE FROM lease_rows WHERE checkpoint_id = ANY(:ids) RETURNING 1),
     at AS (DELETE FROM attempts WHERE checkpoint_id = ANY(:ids) RETURNING 1),
     cp AS (UPDATE checkpoints SET history_pruned_at = :now WHERE id = ANY(:ids) AND state = 'COMMITTED'
            AND history_pruned_at IS NULL RETURNING 1)
SELECT (SELECT count(*) FROM cp) AS checkpoints, (SELECT count(*) FROM at) AS attempts,
       (SELECT count(*) FROM lr) AS lease_rows, (SELECT count(*) FROM ev) AS events
""")

MAX_CHUNK = 5_000


@dataclass(frozen=True)
class PruneOutcome:
    cutoff: datetime  # batches committed before this were prunable
    pruned: int  # batches whose history this call deleted (0 on a dry run)
    more: bool  # prunable batches are left (a dry run: whether there are any)
    candidates: int | None = None  # a dry run: how many batches a prune would take now
    attempts: int = 0
    lease_rows: int = 0
    events: int = 0
    by_sink: dict[str, int] | None = None  # batches pruned (or prunable, on a dry run) by sink name

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class HistoryOperations(CoordinatorBase):
    def prune_history(
        self, older_than: timedelta, actor: str, *, sink: str | None = None, limit: int = 500, dry_run: bool = False,
    ) -> PruneOutcome:
        """Delete the history of up to `limit` COMMITTED batches committed more than `older_than`
        ago (every sink's, or `sink`'s), in one transaction. Call again while `more`."""
        youngest = timedelta(milliseconds=self.limits.history_min_retention_ms)
        if older_than < youngest:
            raise e.Invalid("invalid_prune", f"history younger than {youngest} is kept; older_than was {older_than}")
        if not 1 <= limit <= MAX_CHUNK:
            raise e.Invalid("invalid_prune", f"limit must be 1..{MAX_CHUNK} batches per call, got {limit}")

        def step(conn: Connection) -> PruneOutcome:
            sink_id = repo.sink_by_name(conn, sink, retired=True).id if sink is not None else None
            now = self.clock.now_in(conn)
            cutoff = now - older_than
            names = {r.id: r.name for r in conn.execute(text("SELECT id, name FROM sinks"))}
            if dry_run:
                rows = conn.execute(text(f"SELECT p.sink_id, count(*) AS n FROM ({_PRUNABLE}) AS p GROUP BY p.sink_id"),
                                    {"cutoff": cutoff, "sink_id": sink_id}).all()
                total = sum(r.n for r in rows)
                return PruneOutcome(cutoff, 0, total > 0, candidates=total,
                                    by_sink={names[r.sink_id]: r.n for r in rows})
            chunk = conn.execute(_CHUNK, {"cutoff": cutoff, "sink_id": sink_id, "limit": limit + 1}).all()
            more, chunk = len(chunk) > limit, chunk[:limit]
            if not chunk:
                return PruneOutcome(cutoff, 0, False, by_sink={})
            done = conn.execute(_DELETE, {"ids": [r.id for r in chunk], "now": now}).one()
            by_sink: dict[str, list[int]] = {}
            for r in chunk:
                by_sink.setdefault(names[r.sink_id], []).append(r.batch_id)
            for name, batches in by_sink.items():
                sink_of = next(r.sink_id for r in chunk if names[r.sink_id] == name)
                repo.add_event(conn, sink_of, "history_pruned", actor, now, batches=len(batches),
                               first_batch_id=min(batches), last_batch_id=max(batches),
                               older_than_s=older_than.total_seconds())
            return PruneOutcome(cutoff, done.checkpoints, more, attempts=done.attempts, lease_rows=done.lease_rows,
                                events=done.events, by_sink={k: len(v) for k, v in by_sink.items()})

        outcome = self._tx(step)
        if not dry_run:
            for name, n in (outcome.by_sink or {}).items():
                metrics.HISTORY_PRUNED.labels(name).inc(n)
        if outcome.pruned:
            log.info("pruned the history of %d committed batch(es) older than %s (%s)%s", outcome.pruned,
                     outcome.cutoff.isoformat(), ", ".join(f"{k}: {v}" for k, v in (outcome.by_sink or {}).items()),
                     "; more to prune" if outcome.more else "")
        return outcome
