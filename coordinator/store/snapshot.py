"""The whole durable state as the invariant checker reads it (tests and the simulation)."""

from __future__ import annotations

from sqlalchemy import Connection, select

from ..protocol.invariants import Snapshot
from ..protocol.model import Attempt, Checkpoint, Lease, Sink
from . import events, pool
from .tables import attempts, checkpoints, leases, sinks


def snapshot(conn: Connection) -> Snapshot:
    return Snapshot(
        sinks=[Sink.from_mapping(r._mapping) for r in conn.execute(select(sinks).order_by(sinks.c.id))],
        checkpoints=[Checkpoint.from_mapping(r._mapping) for r in conn.execute(select(checkpoints).order_by(checkpoints.c.id))],
        attempts=[Attempt.from_mapping(r._mapping) for r in conn.execute(select(attempts).order_by(attempts.c.id))],
        leases=[Lease.from_mapping(r._mapping) for r in conn.execute(select(leases).order_by(leases.c.id))],
        quarantines=sorted(pool.quarantines(conn), key=lambda q: (q.sink_id, q.ordinal)),
        alerts=events.alerts(conn),
    )
