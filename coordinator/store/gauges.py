"""What the state-derived metrics read at scrape time (service/metrics.py's DatabaseCollector):
open transactions and the oldest one's age per sink, checkpoints in flight, halted sinks."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text

_OPEN_TRANSACTIONS = text("""
    SELECT s.name, l.state, count(*) AS n, extract(epoch FROM now() - min(l.leased_at)) AS oldest_s
      FROM leases l JOIN sinks s ON s.id = l.sink_id
     WHERE l.resolved_at IS NULL AND l.state <> 'PRELEASED'
     GROUP BY s.name, l.state
""")
_CHECKPOINTS = text("""
    SELECT s.name, c.state, count(*) AS n
      FROM checkpoints c JOIN sinks s ON s.id = c.sink_id
     WHERE c.state IN ('OPEN', 'COMMITTING', 'LOST')
     GROUP BY s.name, c.state
""")
_SINKS = text("SELECT name, halted_at IS NOT NULL AS halted FROM sinks WHERE retired_at IS NULL")


@dataclass(frozen=True)
class Gauges:
    halted: dict[str, bool]  # every live sink: whether it is halted for lost data
    open_transactions: dict[tuple[str, str], int]  # (sink, lease state) -> unresolved leases
    oldest_open_s: dict[str, float]  # sink -> age of its oldest unresolved lease
    checkpoints: dict[tuple[str, str], int]  # (sink, state) -> checkpoints OPEN, COMMITTING or LOST


def read(conn: Connection) -> Gauges:
    halted = {r.name: bool(r.halted) for r in conn.execute(_SINKS)}
    open_rows = conn.execute(_OPEN_TRANSACTIONS).all()
    oldest: dict[str, float] = {}
    for r in open_rows:
        oldest[r.name] = max(oldest.get(r.name, 0.0), float(r.oldest_s or 0.0))
    return Gauges(halted, {(r.name, r.state): r.n for r in open_rows}, oldest,
                  {(r.name, r.state): r.n for r in conn.execute(_CHECKPOINTS)})
