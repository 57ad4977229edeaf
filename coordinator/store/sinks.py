"""Sinks and their generations.

Lock order, to keep concurrent calls free of deadlocks: sink -> checkpoint -> attempt -> leases ->
the sink's id pool. Calls that change what every attempt depends on (a new generation, a lineage
reset, retirement, a halt) lock the sink's row FOR UPDATE; the protocol's calls lock it FOR SHARE,
so they serialise with those changes but not with each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, bindparam, func, insert, select, text, update

from ..protocol import errors as e
from ..protocol.model import Sink
from .tables import generations, id_pools, sinks

Lock = Literal["share", "update"] | None


_BY_NAME = select(sinks).where(sinks.c.name == bindparam("name"))
_BY_NAME_LOCKED = {None: _BY_NAME, "share": _BY_NAME.with_for_update(read=True), "update": _BY_NAME.with_for_update()}


def sink_by_name(conn: Connection, name: str, *, lock: Lock = None, retired: bool = False) -> Sink:
    """The sink, locked as asked. A retired sink is refused (409 sink_retired) unless `retired`."""
    row = conn.execute(_BY_NAME_LOCKED[lock], dict(name=name)).first()
    if row is None:
        raise e.NotFound("unknown_sink", f"no sink named {name!r}", sink=name)
    sink = Sink.from_mapping(row._mapping)
    if not retired:
        refuse_retired(sink)
    return sink


def refuse_retired(sink: Sink) -> None:
    if sink.retired_at is not None:
        raise e.Conflict(e.SINK_RETIRED, f"sink {sink.name!r} was retired at {sink.retired_at.isoformat()}: it takes "
                         "no more calls (its records and event trail stay readable)",
                         retired_at=sink.retired_at.isoformat())


def sink_row(conn: Connection, name: str) -> dict[str, Any] | None:
    """The sink's columns as stored, retired or not (a registration compares them)."""
    row = conn.execute(select(sinks).where(sinks.c.name == name)).first()
    return None if row is None else dict(row._mapping)


def lock_registrations(conn: Connection) -> None:
    """One registration at a time: the prefix-clash check reads every prefix."""
    conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('coordinator.sink_registration'))"))


def prefix_clash(conn: Connection, prefix: str) -> tuple[str, str] | None:
    """A sink (name, prefix) whose prefix starts this one or is started by it."""
    row = conn.execute(
        select(sinks.c.name, sinks.c.transactional_id_prefix).where(
            func.starts_with(sinks.c.transactional_id_prefix, prefix)
            | func.starts_with(prefix, sinks.c.transactional_id_prefix)
        ).limit(1)
    ).first()
    return None if row is None else (row.name, row.transactional_id_prefix)


def insert_sink(conn: Connection, values: dict[str, Any], now: datetime) -> int:
    sink_id = conn.execute(insert(sinks).values(created_at=now, **values).returning(sinks.c.id)).scalar_one()
    conn.execute(insert(id_pools).values(sink_id=sink_id))
    return int(sink_id)


def update_sink(conn: Connection, sink_id: int, **values: Any) -> None:
    conn.execute(update(sinks).where(sinks.c.id == sink_id).values(**values))


def halt(conn: Connection, sink_id: int, reason: str, now: datetime) -> None:
    """Halt the sink for lost data, unless it is halted already (the first reason stays)."""
    conn.execute(update(sinks).where(sinks.c.id == sink_id, sinks.c.halted_at.is_(None))
                 .values(halted_reason=reason, halted_at=now))


def generation_of_run(conn: Connection, sink_id: int, run_id: str) -> int | None:
    return conn.execute(select(generations.c.generation).where(
        generations.c.sink_id == sink_id, generations.c.run_id == run_id)).scalar()


def start_generation(conn: Connection, sink: Sink, query_id: str, run_id: str, now: datetime) -> int:
    generation = sink.generation + 1
    update_sink(conn, sink.id, generation=generation, lineage_query_id=query_id)
    conn.execute(insert(generations).values(sink_id=sink.id, generation=generation, query_id=query_id, run_id=run_id,
                                            started_at=now))
    return generation


def live_sinks(conn: Connection) -> list[Sink]:
    return [Sink.from_mapping(r._mapping) for r in conn.execute(
        select(sinks).where(sinks.c.retired_at.is_(None)).order_by(sinks.c.name))]


def by_ids(conn: Connection, ids: Iterable[int]) -> list[Sink]:
    ids = sorted(set(ids))
    if not ids:
        return []
    return [Sink.from_mapping(r._mapping) for r in conn.execute(select(sinks).where(sinks.c.id.in_(ids)))]


def names_by_id(conn: Connection) -> dict[int, str]:
    return {r.id: r.name for r in conn.execute(select(sinks.c.id, sinks.c.name))}
