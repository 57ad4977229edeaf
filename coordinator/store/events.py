"""The audit trail: one row per event of a sink (and batch), its detail as JSON."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Connection, cast, func, insert, select
from sqlalchemy.dialects.postgresql import JSONPATH

from ..protocol.model import Alert
from .tables import checkpoints, events

_INSERT = insert(events)


def add(conn: Connection, sink_id: int, kind: str, actor: str, at: datetime, checkpoint_id: int | None = None,
        **detail: Any) -> None:
    conn.execute(_INSERT, dict(sink_id=sink_id, checkpoint_id=checkpoint_id, at=at, kind=kind, actor=actor,
                               detail=detail))


def page(conn: Connection, sink_id: int, *, after_id: int = 0, checkpoint_id: int | None = None,
         limit: int = 100, newest_first: bool = False) -> list[dict[str, Any]]:
    """Events with their batch id: oldest first after `after_id`, or the newest `limit`."""
    stmt = select(events, checkpoints.c.batch_id).outerjoin(checkpoints, events.c.checkpoint_id == checkpoints.c.id)
    stmt = stmt.where(events.c.sink_id == sink_id)
    if checkpoint_id is not None:
        stmt = stmt.where(events.c.checkpoint_id == checkpoint_id)
    if newest_first:
        stmt = stmt.order_by(events.c.id.desc())
    else:
        stmt = stmt.where(events.c.id > after_id).order_by(events.c.id)
    return [dict(r._mapping) for r in conn.execute(stmt.limit(limit))]


def alerts(conn: Connection) -> list[Alert]:
    """The events the invariant checker reads (data_lost, lost_data_acknowledged)."""
    rows = conn.execute(select(events.c.id, events.c.sink_id, events.c.checkpoint_id, events.c.kind, events.c.at)
                        .where(events.c.kind.in_(["data_lost", "lost_data_acknowledged"])).order_by(events.c.id))
    return [Alert(r.id, r.sink_id, r.checkpoint_id, r.kind, r.at) for r in rows]


def warned_lease_ids(conn: Connection, sink_id: int, checkpoint_ids: Iterable[int]) -> set[int]:
    """The leases of these checkpoints already named by a `transaction_near_timeout` event (each
    lists its leases as [lease id, ...])."""
    ids = sorted(set(checkpoint_ids))
    if not ids:
        return set()
    first_of_each = cast("$.leases[*][0]", JSONPATH)
    listed = select(cast(func.jsonb_path_query(events.c.detail, first_of_each), BigInteger)).where(
        events.c.sink_id == sink_id, events.c.kind == "transaction_near_timeout", events.c.checkpoint_id.in_(ids))
    return set(conn.execute(listed).scalars())
