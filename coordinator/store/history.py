"""Pruning old batch history: the attempts, leases and events of COMMITTED batches committed
before a cutoff are deleted, a chunk of batches per transaction; each checkpoint row stays, marked
`history_pruned_at` (service/history.py says what is kept and why).

The chunk's checkpoints are locked (FOR UPDATE SKIP LOCKED) before anything of theirs is deleted,
so a concurrent begin, resume or read of one of them waits for the chunk and then sees it pruned.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, text

# The prunable COMMITTED checkpoints: not each query's newest committed batch, no attempt still
# open, no lease still holding its id. `sink_id` NULL: every sink's.
_PRUNABLE = """
    SELECT c.id, c.sink_id, c.batch_id FROM checkpoints AS c
    WHERE c.state = 'COMMITTED' AND c.history_pruned_at IS NULL AND c.committed_at < :cutoff
    AND (CAST(:sink_id AS bigint) IS NULL OR c.sink_id = :sink_id)
    AND c.batch_id < (SELECT max(n.batch_id) FROM checkpoints AS n
                      WHERE n.sink_id = c.sink_id AND n.query_id = c.query_id AND n.state = 'COMMITTED')
    AND NOT EXISTS (SELECT 1 FROM attempts AS a WHERE a.checkpoint_id = c.id AND a.state = 'OPEN')
    AND NOT EXISTS (SELECT 1 FROM leases AS l WHERE l.checkpoint_id = c.id AND l.resolved_at IS NULL)
"""
_CHUNK = text(f"{_PRUNABLE} ORDER BY c.committed_at, c.id LIMIT :limit FOR UPDATE OF c SKIP LOCKED")
_COUNT = text(f"SELECT p.sink_id, count(*) AS n FROM ({_PRUNABLE}) AS p GROUP BY p.sink_id")
# one statement: the chunk's events, leases and attempts deleted, its checkpoints marked
_DELETE = text("""
WITH ev AS (DELETE FROM events WHERE checkpoint_id = ANY(:ids) RETURNING 1),
     le AS (DELETE FROM leases WHERE checkpoint_id = ANY(:ids) RETURNING 1),
     at AS (DELETE FROM attempts WHERE checkpoint_id = ANY(:ids) RETURNING 1),
     cp AS (UPDATE checkpoints SET history_pruned_at = :now WHERE id = ANY(:ids) AND state = 'COMMITTED'
            AND history_pruned_at IS NULL RETURNING 1)
SELECT (SELECT count(*) FROM cp) AS checkpoints, (SELECT count(*) FROM at) AS attempts,
       (SELECT count(*) FROM le) AS leases, (SELECT count(*) FROM ev) AS events
""")


@dataclass(frozen=True)
class Pruned:
    checkpoints: int
    attempts: int
    leases: int
    events: int


def prunable_counts(conn: Connection, cutoff: datetime, sink_id: int | None) -> dict[int, int]:
    return {r.sink_id: r.n for r in conn.execute(_COUNT, {"cutoff": cutoff, "sink_id": sink_id})}


def lock_chunk(conn: Connection, cutoff: datetime, sink_id: int | None, limit: int) -> list[tuple[int, int, int]]:
    """Up to `limit` prunable batches (id, sink id, batch id), oldest commit first, locked."""
    rows = conn.execute(_CHUNK, {"cutoff": cutoff, "sink_id": sink_id, "limit": limit})
    return [(r.id, r.sink_id, r.batch_id) for r in rows]


def delete_chunk(conn: Connection, checkpoint_ids: list[int], now: datetime) -> Pruned:
    r = conn.execute(_DELETE, {"ids": checkpoint_ids, "now": now}).one()
    return Pruned(r.checkpoints, r.attempts, r.leases, r.events)


@dataclass(frozen=True)
class Kept:
    bytes: int  # the history's tables on disk (attempts, leases, events: what pruning deletes)
    batches: int  # committed batches whose history is kept
    oldest: datetime | None  # the oldest of them committed then


_SIZE = text("SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class AS c "
             "WHERE c.relname IN ('attempts', 'leases', 'events') AND c.relkind = 'r'")
_KEPT = text("SELECT count(*) AS n, min(committed_at) AS oldest FROM checkpoints "
             "WHERE state = 'COMMITTED' AND history_pruned_at IS NULL")


def kept(conn: Connection) -> Kept:
    size = int(conn.execute(_SIZE).scalar_one() or 0)
    row = conn.execute(_KEPT).one()
    return Kept(size, int(row.n), row.oldest)
