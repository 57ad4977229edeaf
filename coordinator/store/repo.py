"""Reads and compare-and-set writes on the tables, shared by the service's operations.

Lock order, to keep concurrent calls free of deadlocks: sink -> checkpoint -> attempt -> lease ->
transactional id. Every state change goes through `cas`, which checks the move against the state
machine and updates only rows still in the expected old state.

Leases are read through the views `leases` and `unresolved_leases` and written in `lease_rows`:
a batch's first tries live on their attempt row until `materialize_first_tries` copies them into
lease_rows, which every writer of a lease (other than the common path's statements in hot_path)
calls first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from enum import StrEnum
from functools import cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    ClauseElement,
    ColumnElement,
    Connection,
    Row,
    Select,
    Table,
    Update,
    any_,
    bindparam,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ..protocol import errors as e
from ..protocol import states as st
from ..protocol.invariants import Snapshot
from ..protocol.model import Alert, Attempt, Checkpoint, Lease, Sink, TransactionalId
from ..protocol.states import TransactionalIdState, require_transition
from .driver_sql import DriverStatement
from .tables import (
    attempt_columns,
    attempt_of_first_try_id,
    attempts,
    checkpoints,
    events,
    lease_rows,
    leases,
    sinks,
    transactional_ids,
    unresolved_leases,
)


def cas(
    conn: Connection,
    table: Table,
    ids: Iterable[int],
    old: Iterable[StrEnum],
    new: StrEnum,
    *,
    where: Sequence[Any] = (),
    **values: Any,
) -> list[Row]:
    """UPDATE table SET state=new WHERE id IN ids AND state IN old; returns the rows it changed,
    by id (RETURNING gives them in physical order, which vacuum and updates shuffle: callers act on
    Kafka in this order, and the simulation replays a seed only if it is fixed)."""
    ids = list(ids)
    old = list(old)
    for state in old:
        require_transition(state, new)
    if not ids:
        return []
    if not where and not any(isinstance(v, ClauseElement) for v in values.values()):
        stmt = _cas_stmt(table, tuple(str(s) for s in old), str(new), tuple(values))
        return _by_id(conn.execute(stmt, {"cas_ids": ids, **{f"cas_{k}": v for k, v in values.items()}}))
    stmt = (
        update(table)
        .where(table.c.id.in_(ids), table.c.state.in_([str(s) for s in old]), *where)
        .values(state=str(new), **values)
        .returning(*table.c)
    )
    return _by_id(conn.execute(stmt))


def _by_id(rows: Iterable[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: r.id)


# Building a Core statement and its cache key costs about as much CPU as executing it. The hot
# statements below have a fixed shape, so each is built once (per lock mode) and executed with
# bound parameters. Lists of ids go as one array parameter (`= ANY(:ids)`), not an expanded IN
# list: the SQL text is then the same for 2 or 200 ids, so psycopg parses and prepares it once
# instead of once per call (a 200-id IN list cost more client CPU than the update itself).


def _id_array(name: str) -> Any:
    return any_(bindparam(name, type_=ARRAY(BigInteger)))


@cache
def _cas_stmt(table: Table, old: tuple[str, ...], new: str, keys: tuple[str, ...]) -> Update:
    return (
        update(table)
        .where(table.c.id == _id_array("cas_ids"), table.c.state.in_(list(old)))
        .values(state=new, **{k: bindparam(f"cas_{k}", type_=table.c[k].type) for k in keys})
        .returning(*table.c)
    )


_INSERT_EVENT = insert(events)


def add_event(
    conn: Connection,
    sink_id: int,
    kind: str,
    actor: str,
    at: datetime,
    checkpoint_id: int | None = None,
    **detail: Any,
) -> None:
    conn.execute(
        _INSERT_EVENT,
        dict(sink_id=sink_id, checkpoint_id=checkpoint_id, at=at, kind=kind, actor=actor, detail=detail),
    )


# --- typed reads -----------------------------------------------------------------------------


def _as_sink(row: Row) -> Sink:
    return Sink.from_mapping(row._mapping)


def as_checkpoint(row: Row) -> Checkpoint:
    return Checkpoint.from_mapping(row._mapping)


def as_attempt(row: Row) -> Attempt:
    return Attempt.from_mapping(row._mapping)


def as_lease(row: Row) -> Lease:
    return Lease.from_mapping(row._mapping)


def as_transactional_id(row: Row) -> TransactionalId:
    return TransactionalId.from_mapping(row._mapping)


@cache
def _sink_by_name_stmt(lock: str | None) -> Select:
    stmt = select(sinks).where(sinks.c.name == bindparam("name"))
    if lock == "update":
        stmt = stmt.with_for_update()
    elif lock == "share":
        stmt = stmt.with_for_update(read=True)
    return stmt


def sink_by_name(conn: Connection, name: str, lock: str | None = None, *, retired: bool = False) -> Sink:
    """The sink; a retired one only with `retired=True` (otherwise 409 sink_retired: it takes no calls)."""
    row = conn.execute(_sink_by_name_stmt(lock), {"name": name}).first()
    if row is None:
        raise e.NotFound("unknown_sink", f"no sink named {name!r}", sink=name)
    sink = _as_sink(row)
    if sink.retired_at is not None and not retired:
        raise e.Conflict(e.SINK_RETIRED, f"sink {name!r} was retired at {sink.retired_at:%Y-%m-%d %H:%M:%S}Z; its "
                         "name and transactional id prefix stay reserved (register a new sink under other ones)",
                         sink=name)
    return sink


@cache
def _checkpoint_stmt(lock: bool) -> Select:
    stmt = select(checkpoints).where(
        checkpoints.c.sink_id == bindparam("sink_id"),
        checkpoints.c.query_id == bindparam("query_id"),
        checkpoints.c.batch_id == bindparam("batch_id"),
    )
    return stmt.with_for_update() if lock else stmt


def checkpoint_for(
    conn: Connection, sink: Sink, batch_id: int, *, query_id: str | None = None, lock: bool = False
) -> Checkpoint:
    qid = query_id if query_id is not None else sink.lineage_query_id
    params = {"sink_id": sink.id, "query_id": qid, "batch_id": batch_id}
    row = conn.execute(_checkpoint_stmt(bool(lock)), params).first() if qid is not None else None
    if row is None:
        raise e.NotFound("unknown_checkpoint", f"sink {sink.name!r} has no checkpoint for batch {batch_id}", batch_id=batch_id)
    return as_checkpoint(row)


@cache
def _attempt_of_stmt(lock: str | None) -> Select:
    stmt = select(*attempt_columns).where(
        attempts.c.checkpoint_id == bindparam("checkpoint_id"), attempts.c.number == bindparam("number")
    )
    if lock == "update":
        stmt = stmt.with_for_update()
    elif lock == "key_share":
        stmt = stmt.with_for_update(read=True, key_share=True)
    return stmt


def attempt_of(conn: Connection, checkpoint_id: int, number: int, lock: str | None = None) -> Attempt:
    row = conn.execute(_attempt_of_stmt(lock), {"checkpoint_id": checkpoint_id, "number": number}).first()
    if row is None:
        raise e.NotFound("unknown_attempt", f"checkpoint has no attempt {number}", attempt=number)
    return as_attempt(row)


@cache
def _attempt_by_id_stmt(lock: str | None) -> Select:
    stmt = select(*attempt_columns).where(attempts.c.id == bindparam("attempt_id"))
    if lock == "key_share":
        stmt = stmt.with_for_update(read=True, key_share=True)
    return stmt


def attempt_by_id(conn: Connection, attempt_id: int, lock: str | None = None) -> Attempt:
    return as_attempt(conn.execute(_attempt_by_id_stmt(lock), {"attempt_id": attempt_id}).one())


def attempts_of_checkpoint(conn: Connection, checkpoint_id: int) -> list[Attempt]:
    rows = conn.execute(select(*attempt_columns).where(attempts.c.checkpoint_id == checkpoint_id).order_by(attempts.c.number))
    return [as_attempt(r) for r in rows]


def unresolved_in(*states: st.LeaseState) -> ColumnElement[bool]:
    """`state IN (states)` on the view unresolved_leases (states that may hold an open transaction)."""
    if not set(states) <= st.UNRESOLVED_LEASE_STATES:
        raise ValueError(f"not unresolved lease states: {sorted(set(states) - st.UNRESOLVED_LEASE_STATES)}")
    return unresolved_leases.c.state.in_(sorted(s.value for s in states))


def leases_where(conn: Connection, *conditions: Any, source: Table = leases, lock: bool = False) -> list[Lease]:
    """Leases by id from `source`: the view leases (filter by attempt or checkpoint), the view
    unresolved_leases (with unresolved_in), or lease_rows (to lock them, after materialising)."""
    stmt = select(source).where(*conditions).order_by(source.c.id)
    if lock:
        if source is not lease_rows:
            raise ValueError("only lease rows can be locked: materialise the first tries, then lock lease_rows")
        stmt = stmt.with_for_update()
    return [as_lease(r) for r in conn.execute(stmt)]


def _by_lease_id(lease_id: int) -> tuple[Table, list[ColumnElement[bool]]]:
    """Where a lease of this id is found without a scan: a lease row's id in lease_rows; a first
    try's id in the view leases, narrowed to the attempt the id names."""
    attempt_id = attempt_of_first_try_id(lease_id)
    if attempt_id is None:
        return lease_rows, [lease_rows.c.id == lease_id]
    return leases, [leases.c.attempt_id == attempt_id, leases.c.id == lease_id]


def lease_by_id(conn: Connection, sink: Sink, lease_id: int, lock: bool = False) -> Lease:
    """The lease; `lock` locks its row (the caller materialised its attempt's first tries)."""
    source, where = (lease_rows, [lease_rows.c.id == lease_id]) if lock else _by_lease_id(lease_id)
    found = leases_where(conn, *where, source.c.sink_id == sink.id, source=source, lock=lock)
    if not found:
        raise e.NotFound("unknown_lease", f"sink {sink.name!r} has no lease {lease_id}", lease_id=lease_id)
    return found[0]


def attempt_of_lease(conn: Connection, sink: Sink, lease_id: int, lock: str | None = None) -> Attempt:
    """The attempt a lease of the sink belongs to, in one statement (the lease row is not locked)."""
    source, where = _by_lease_id(lease_id)
    attempt_id = select(source.c.attempt_id).where(*where, source.c.sink_id == sink.id).scalar_subquery()
    stmt = select(*attempt_columns).where(attempts.c.id == attempt_id)
    if lock == "key_share":
        stmt = stmt.with_for_update(read=True, key_share=True, of=attempts)  # not the lease row
    row = conn.execute(stmt).first()
    if row is None:
        raise e.NotFound("unknown_lease", f"sink {sink.name!r} has no lease {lease_id}", lease_id=lease_id)
    return as_attempt(row)


# The attempts among these whose first tries are still on their row, locked (FOR NO KEY UPDATE:
# it waits for a decision or a mark of the attempt in progress, but not for a KEY SHARE lock, which
# a retry's lease holds while it materialises).
_LOCK_FIRST_TRIES = text(
    "SELECT id FROM attempts WHERE id = ANY(CAST(:ids AS bigint[])) AND first_tids IS NOT NULL "
    "ORDER BY id FOR NO KEY UPDATE"
)

# A statement of its own, after the lock: its snapshot then shows the attempt as its last writer
# left it (a statement's snapshot is taken before its lock waits).
_LEASE_COLUMNS = ", ".join(c.name for c in lease_rows.c)
_MATERIALIZE = text(f"""
WITH copied AS (
    INSERT INTO lease_rows ({_LEASE_COLUMNS})
    SELECT {_LEASE_COLUMNS} FROM first_try_leases WHERE attempt_id = ANY(CAST(:ids AS bigint[]))
)
UPDATE attempts SET first_tids = NULL, first_deadline_at = NULL, first_records = NULL
WHERE id = ANY(CAST(:ids AS bigint[]))
""")


def first_tries_in_two_places(conn: Connection, sink_id: int) -> list[int]:
    """Attempts of the sink with first tries on their row and lease rows too (the simulation's
    storage check: materialize_first_tries must move them, never copy them)."""
    return list(conn.execute(
        select(attempts.c.id).where(
            attempts.c.sink_id == sink_id, attempts.c.first_tids.is_not(None),
            select(lease_rows.c.id).where(lease_rows.c.attempt_id == attempts.c.id).exists(),
        ).order_by(attempts.c.id)
    ).scalars())


def materialize_first_tries(conn: Connection, attempt_ids: Iterable[int]) -> None:
    """Copy the first tries still on these attempts' rows into lease_rows (same ids, same fields)
    and clear them from the rows, in the caller's transaction. Every change to a lease other than
    the common path's (begin, the decision with every winner a first try with its record, the
    committed mark of all winners) calls this first, for the leases' attempts."""
    ids = sorted(set(attempt_ids))
    if not ids:
        return
    locked = conn.execute(_LOCK_FIRST_TRIES, {"ids": ids}).scalars().all()
    if locked:
        conn.execute(_MATERIALIZE, {"ids": list(locked)})


# --- the transactional id pool ---------------------------------------------------------------


# The pool's query (begin, a retry's lease): run on the driver's connection, see driver_sql. It
# reads the sink's ids (by its unique (sink_id, ordinal)) and sorts them: an index on released_at
# would make every free a non-HOT update (migration 0013), and a sink's pool is about its partition
# count. It runs its generic plan: planned for any sink, which reads the sink's ids by that index
# only because the planner is told a sink has a few ids (migration 0016); one sink with most of the
# table's ids would otherwise make it scan the table.
#
# The sink is named, not given by id, so begin can send the query with its first statement, in the
# same round trip (hot_path.begin_head): `:new_batch_id` then limits it to a checkpoint of the
# sink's query that has no attempt yet (what that statement just created), so a begin that will
# take no new attempt locks no id. Without `:now`, quarantine ends are compared with the
# transaction's start, which precedes any time the begin writes.
FREE_IDS = DriverStatement("""
SELECT id, transactional_id FROM transactional_ids
WHERE sink_id = (SELECT id FROM sinks WHERE name = :sink_name) AND state = 'FREE'
AND (reusable_at IS NULL OR reusable_at <= COALESCE(CAST(:now AS timestamptz), transaction_timestamp()))
AND (CAST(:new_batch_id AS bigint) IS NULL OR EXISTS (
    SELECT 1 FROM sinks AS s JOIN checkpoints AS c ON c.sink_id = s.id AND c.query_id = s.lineage_query_id
    WHERE s.name = :sink_name AND c.batch_id = :new_batch_id AND c.current_attempt = 0 AND c.state = 'OPEN'))
ORDER BY released_at, ordinal
LIMIT :n
FOR UPDATE SKIP LOCKED
""", generic_plan=True)


def take_free_transactional_ids(
    conn: Connection, sink: Sink, n: int, now: datetime, prefix_for: Any, locked: Sequence[tuple[int, str]] = (),
) -> list[tuple[int, str]]:
    """Lock n FREE ids of the sink, least recently released first and none still in quarantine
    (SKIP LOCKED, so concurrent callers never wait on each other), growing the pool for the rest.
    The rows stay locked by this transaction until it commits. `locked`: ids of the sink this
    transaction already took with FREE_IDS (at most n), the first of those returned.

    Growing takes a per-sink advisory lock held to commit, so growers take turns: without it,
    concurrent growers race for the same next ordinals (a spurious pool_exhausted and a racy
    max_pool_size check)."""
    taken: list[tuple[int, str]] = list(locked)
    if len(taken) > n:
        raise ValueError(f"{len(taken)} ids locked for {n}")
    if len(taken) == n:
        return taken
    growing = False
    for _ in range(64):
        rows = FREE_IDS.rows(conn, {"sink_name": sink.name, "now": now, "new_batch_id": None, "n": n - len(taken)})
        held = set(taken)  # rows this transaction locked already come back (SKIP LOCKED skips others' only)
        taken += [pair for pair in map(tuple, rows) if pair not in held]
        if len(taken) == n:
            return taken
        if not growing:
            # the two-key form: its key space never overlaps the single-key locks used elsewhere
            conn.execute(
                select(func.pg_advisory_xact_lock(func.hashtext("coordinator.pool_growth"), func.hashtext(str(sink.id))))
            )
            growing = True
            continue  # look for FREE ids again: some may have been released while we waited
        size, next_ordinal = conn.execute(
            select(func.count(), func.coalesce(func.max(transactional_ids.c.ordinal) + 1, 0)).where(
                transactional_ids.c.sink_id == sink.id
            )
        ).one()
        wanted = n - len(taken)
        if size + wanted > sink.max_pool_size:
            raise e.Unavailable(
                e.POOL_EXHAUSTED,
                f"sink {sink.name!r} has all {sink.max_pool_size} transactional ids leased, awaiting abort "
                "or in quarantine; retry later, or raise max_pool_size if partitions x task attempts need more",
                max_pool_size=sink.max_pool_size,
            )
        new = conn.execute(
            pg_insert(transactional_ids)
            .values([
                dict(sink_id=sink.id, ordinal=o, transactional_id=prefix_for(o), state=TransactionalIdState.FREE.value)
                for o in range(next_ordinal, next_ordinal + wanted)
            ])
            .on_conflict_do_nothing()
            .returning(transactional_ids.c.id, transactional_ids.c.transactional_id)
        ).all()
        taken += [(r.id, r.transactional_id) for r in new]
        if len(taken) == n:
            return taken
    raise e.Unavailable(e.POOL_EXHAUSTED, "could not take transactional ids under contention; retry")


def take_free_transactional_id(conn: Connection, sink: Sink, now: datetime, prefix_for: Any) -> tuple[int, str]:
    (taken,) = take_free_transactional_ids(conn, sink, 1, now, prefix_for)
    return taken


def hand_out_transactional_ids(conn: Connection, pairs: Sequence[tuple[int, int]]) -> None:
    """(transactional id row, lease id) pairs: each FREE id (locked by take_free_transactional_ids)
    becomes LEASED by its lease, in one statement."""
    if not pairs:
        return
    require_transition(TransactionalIdState.FREE, TransactionalIdState.LEASED)
    conn.execute(_HAND_OUT_IDS, {"tid_rows": [p[0] for p in pairs], "lease_ids": [p[1] for p in pairs]})


_HAND_OUT_IDS = text(
    "UPDATE transactional_ids AS t SET state = 'LEASED', lease_id = v.lease_id "
    "FROM unnest(CAST(:tid_rows AS bigint[]), CAST(:lease_ids AS bigint[])) AS v(id, lease_id) "
    "WHERE t.id = v.id AND t.state = 'FREE'"
)


def release_transactional_ids(
    conn: Connection, lease_ids: Sequence[int], now: datetime, quarantine_until: datetime | None = None
) -> None:
    """The leases are resolved (committed or aborted on Kafka): their ids may be leased again, at
    once, or -- an id freed from an undecided try -- only after `quarantine_until`."""
    if not lease_ids:
        return
    require_transition(TransactionalIdState.LEASED, TransactionalIdState.FREE)
    conn.execute(
        _RELEASE_IDS, {"released_lease_ids": list(lease_ids), "released_at": now, "reusable_at": quarantine_until}
    )


# a resolved lease's id, found by its unique transactional_id (lease_id is not indexed: leasing
# an id stays a HOT update), and only while that lease still holds it. The ids are reached through
# the array of the leases' transactional ids, not a join: for 40 leases the planner hashed the
# whole pool, every sink's ids, to join them. The two sets match the pairs, as in the committed
# mark (hot_path): an id held by one of these leases names it, and no other lease holds it.
_RELEASE_IDS = text(
    "UPDATE transactional_ids AS t SET state = 'FREE', lease_id = NULL, released_at = :released_at, "
    "reusable_at = CAST(:reusable_at AS timestamptz) "
    "WHERE t.transactional_id = ANY(ARRAY(SELECT l.transactional_id FROM lease_rows AS l "
    "WHERE l.id = ANY(CAST(:released_lease_ids AS bigint[])))) "
    "AND t.lease_id = ANY(CAST(:released_lease_ids AS bigint[])) AND t.state = 'LEASED'"
)


# --- whole-state snapshot (tests, invariant checks, simulation) ----------------------------------


def snapshot(conn: Connection) -> Snapshot:
    return Snapshot(
        sinks=[_as_sink(r) for r in conn.execute(select(sinks).order_by(sinks.c.id))],
        checkpoints=[as_checkpoint(r) for r in conn.execute(select(checkpoints).order_by(checkpoints.c.id))],
        attempts=[as_attempt(r) for r in conn.execute(select(*attempt_columns).order_by(attempts.c.id))],
        leases=[as_lease(r) for r in conn.execute(select(leases).order_by(leases.c.id))],
        transactional_ids=[
            as_transactional_id(r) for r in conn.execute(select(transactional_ids).order_by(transactional_ids.c.id))
        ],
        alerts=[
            Alert(r.id, r.sink_id, r.checkpoint_id, r.kind, r.at)
            for r in conn.execute(
                select(events.c.id, events.c.sink_id, events.c.checkpoint_id, events.c.kind, events.c.at)
                .where(events.c.kind.in_(ALERT_KINDS))
                .order_by(events.c.id)
            )
        ],
    )


ALERT_KINDS = ("data_lost", "lost_data_acknowledged")
