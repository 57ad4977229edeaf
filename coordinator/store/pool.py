"""A sink's pool of transactional ids: its row (size and cursor), which ordinals are busy, and
the quarantine. Which ids a grant takes is the rule `rules.pick_ids`; this module only reads what
it needs and writes what it decided.

Busy: held by an unresolved lease (I3) or quarantined until later than now (no quick reuse).
Grants lock the pool's row, so two grants of one sink never pick the same free id; the unique
index over unresolved leases would refuse the second anyway.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import Connection, bindparam, func, select, union_all, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ..protocol.model import IdPool, Quarantine
from .tables import id_pools, leases, quarantined_ids


# built once: every grant runs them
_LOCK = select(id_pools).where(id_pools.c.sink_id == bindparam("sink_id")).with_for_update()
_BUSY = select(func.array_agg(union_all(
    select(leases.c.ordinal).where(leases.c.sink_id == bindparam("sink_id"), leases.c.resolved_at.is_(None)),
    select(quarantined_ids.c.ordinal).where(quarantined_ids.c.sink_id == bindparam("sink_id"),
                                            quarantined_ids.c.until > bindparam("now")),
).subquery().c.ordinal))
_SAVE = update(id_pools).where(id_pools.c.sink_id == bindparam("pool_sink_id"))


def lock(conn: Connection, sink_id: int) -> IdPool:
    return IdPool.from_mapping(conn.execute(_LOCK, dict(sink_id=sink_id)).one()._mapping)


def read(conn: Connection, sink_id: int) -> IdPool:
    return IdPool.from_mapping(conn.execute(select(id_pools).where(id_pools.c.sink_id == sink_id)).one()._mapping)


def busy(conn: Connection, sink_id: int, now: datetime) -> set[int]:
    """Held by an unresolved lease or quarantined past `now` (one row, whatever their number)."""
    return set(conn.execute(_BUSY, dict(sink_id=sink_id, now=now)).scalar_one() or ())


def save(conn: Connection, pool: IdPool) -> None:
    conn.execute(_SAVE, dict(pool_sink_id=pool.sink_id, size=pool.size, cursor=pool.cursor))


def quarantine(conn: Connection, sink_id: int, ordinals: Iterable[int], until: datetime) -> None:
    """None of these ids is leased before `until` (an earlier end already set stays if later)."""
    rows = [dict(sink_id=sink_id, ordinal=n, until=until) for n in sorted(set(ordinals))]
    if not rows:
        return
    stmt = pg_insert(quarantined_ids).values(rows)
    conn.execute(stmt.on_conflict_do_update(index_elements=["sink_id", "ordinal"],
                                            set_={"until": func.greatest(quarantined_ids.c.until, stmt.excluded.until)}))


def quarantines(conn: Connection) -> list[Quarantine]:
    return [Quarantine.from_mapping(r._mapping) for r in conn.execute(select(quarantined_ids))]
