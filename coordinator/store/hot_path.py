"""The statements of the protocol's common path (a new attempt at begin, the decision and the
finish of a commit), each a single round trip that reads or writes several tables at once.

The service keeps the judging: these statements only read what the pure rules need (with the
locks the step needs, and the database's clock read after those locks) and write what the rules
decided. Every state change here is one the state machine allows (checked before executing, as
`repo.cas` does) and is a compare-and-set on the old state; the caller checks the row counts.
Each statement is built once at import, with arrays for the P rows, so its SQL is the same for
every call and every P, and runs prepared on the connection's libpq handle (`driver_sql`: no
SQLAlchemy compilation or result metadata per call, no psycopg cursor, prepared once per session).

On the common path a batch's first tries stay on its attempt row (migration 0012): begin writes
them there, the decision adds their records, the mark commits them with the attempt. A new batch's
begin, the commit's decision with its locks and the deciding call's mark each have a statement
for that common case (`begin_new_batch`, `decide_first_tries`, `mark_first_tries_committed`):
guarded by what makes the case common, it writes nothing otherwise, and the caller runs the
general statements. Any other path turns them into lease rows first
(repo.materialize_first_tries), and these statements then work on lease_rows as before.

Long because each statement carries the reasons for its shape (locks, snapshots, plans) beside
the function that runs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import pydantic_core
from sqlalchemy import Column, Connection, Table

from ..protocol.model import (
    FIRST_TRY_TASK_ATTEMPT,
    Attempt,
    Checkpoint,
    Lease,
    PartitionResult,
    PrecommitRecord,
    Sink,
)
from ..protocol.states import (
    AttemptState,
    CheckpointState,
    LeaseState,
    TransactionalIdState,
    require_transition,
)
from .driver_sql import (
    DriverStatement,
    int_array,
    run_together,
    text_array,
    transaction_started,
)
from .repo import FREE_IDS
from .tables import (
    FIRST_TRY_ID_BASE,
    FIRST_TRY_ID_STRIDE,
    attempt_columns,
    attempt_of_first_try_id,
    checkpoints,
    first_try_lease_id,
    lease_rows,
    leases,
    sinks,
)


def _cols(columns: Table | Iterable[Column[Any]], alias: str, prefix: str) -> str:
    return ", ".join(f"{alias}.{c.name} AS {prefix}{c.name}" for c in (columns.c if isinstance(columns, Table) else columns))


def _names(table: Table) -> str:
    return ", ".join(c.name for c in table.c)


def _json(value: Any) -> str:
    """JSON text for a parameter (a jsonb one, or the decision's records stored as text), encoded
    by pydantic's core: a 200-partition decision's records (~34 KB) in ~0.13 ms, against ~0.75 ms
    through json.dumps. The same JSON value (ints beyond 64 bits and non-string keys as json.dumps
    takes them), only compact and with text left unescaped, which jsonb stores alike."""
    return pydantic_core.to_json(value).decode()


# --- begin --------------------------------------------------------------------------------------


# Begin's first statement: the sink, the clock, and the checkpoint of the batch created if new or
# locked if not (ON CONFLICT DO UPDATE locks the existing row as FOR UPDATE would, and returns its
# latest version after waiting for a lock). The offsets digest is bound at the first begin that
# names it (COALESCE keeps a bound one, so the caller's check sees the bound digest). A sink that
# takes no batch (retired, or no query bound) gets no checkpoint: the caller raises, and any
# other refusal (generation, halt) rolls the insert back. For a new checkpoint the statement also
# reads what the rest of begin needs (no attempt and no lease of its own yet); for an existing one
# the caller reads that in a statement of its own, whose snapshot is taken after the lock.
# `inserted` is PostgreSQL's xmax = 0 of the returned version: set by ON CONFLICT's lock otherwise.
# With a partition count, the pool's query (repo.FREE_IDS) follows it in the same round trip.
_BEGIN_HEAD = DriverStatement(f"""
WITH s AS (
    SELECT *, clock_timestamp() AS db_now FROM sinks WHERE name = :name
), c AS (
    INSERT INTO checkpoints AS c (sink_id, query_id, batch_id, state, current_attempt, created_at, offsets_digest)
    SELECT s.id, s.lineage_query_id, :batch_id, 'OPEN', 0, COALESCE(CAST(:now AS timestamptz), s.db_now),
           :offsets_digest
    FROM s WHERE s.retired_at IS NULL AND s.lineage_query_id IS NOT NULL
    ON CONFLICT (sink_id, query_id, batch_id)
    DO UPDATE SET offsets_digest = COALESCE(c.offsets_digest, EXCLUDED.offsets_digest)
    RETURNING c.*, c.xmax = 0 AS inserted
)
SELECT {_cols(sinks, 's', 's_')}, s.db_now, {_cols(checkpoints, 'c', 'c_')}, c.inserted,
    (SELECT array_agg(o.id ORDER BY o.id) FROM attempts AS o
     WHERE o.sink_id = s.id AND o.state = 'OPEN' AND o.finished_at IS NULL) AS open_attempt_ids,
    (SELECT array_agg(u.id ORDER BY u.id) FROM checkpoints AS u
     WHERE u.sink_id = s.id AND u.state = 'COMMITTING') AS unfinished_ids
FROM s LEFT JOIN c ON true
""")

# What the rest of begin reads for an existing checkpoint, unlocked, in a statement of its own (its
# snapshot is taken after the checkpoint's lock was granted, so it sees what the lock's previous
# holder committed): the latest attempt, the sink's OPEN attempts (to abort: the caller then locks
# them), decided commits of other batches still finishing, and the checkpoint's aborted or
# aborting leases.
_BEGIN_READS = DriverStatement(f"""
SELECT {_cols(attempt_columns, 'a', 'a_')},
    (SELECT array_agg(o.id ORDER BY o.id) FROM attempts AS o
     WHERE o.sink_id = :sink_id AND o.state = 'OPEN' AND o.finished_at IS NULL) AS open_attempt_ids,
    (SELECT array_agg(u.id ORDER BY u.id) FROM checkpoints AS u
     WHERE u.sink_id = :sink_id AND u.state = 'COMMITTING' AND u.id <> :checkpoint_id) AS unfinished_ids,
    (SELECT array_agg(ARRAY[l.attempt_id::text, l.state, l.transactional_id] ORDER BY l.id) FROM leases AS l
     WHERE l.checkpoint_id = :checkpoint_id AND l.state IN ('ABORTED', 'ABORTING')) AS ended_leases
FROM (SELECT 1) AS one LEFT JOIN attempts AS a ON a.checkpoint_id = :checkpoint_id AND a.number = :current_attempt
""")


class EndedLease(NamedTuple):
    """An aborted (or aborting) lease as begin's answer names it."""

    attempt_id: int
    state: LeaseState
    transactional_id: str


class CheckpointHead(NamedTuple):
    checkpoint: Checkpoint
    latest: Attempt | None
    open_attempt_ids: list[int]
    unfinished_ids: list[int]
    ended_leases: list[EndedLease]


class BeginHead(NamedTuple):
    sink: Sink
    db_now: datetime  # the database's clock, read before the checkpoint's lock
    head: CheckpointHead | None  # None: the sink takes no batch (retired, or no query bound)
    # FREE ids of the sink locked for a checkpoint without an attempt yet (see begin_head)
    locked_ids: list[tuple[int, str]]


def begin_head(
    conn: Connection, name: str, batch_id: int, now: datetime | None, offsets_digest: str | None, ids: int = 0,
) -> BeginHead | None:
    """The sink, the clock and the batch's checkpoint (created or locked) with what begin reads
    next; None if there is no such sink. `now` is the checkpoint's creation time when the clock is
    not the database's (None: the statement's clock). With `ids`, the pool's query goes in the same
    round trip: if the checkpoint has no attempt yet (the common case: just created), up to that
    many FREE ids of the sink are locked for its first tries (`locked_ids`, for
    take_free_transactional_ids); otherwise none."""
    head_params = {"name": name, "batch_id": batch_id, "now": now, "offsets_digest": offsets_digest}
    if ids:
        heads, locked = run_together(conn, [(_BEGIN_HEAD, head_params), (FREE_IDS, {
            "sink_name": name, "now": now, "new_batch_id": batch_id, "n": ids,
        })])
    else:
        heads, locked = _BEGIN_HEAD.rows(conn, head_params), []
    row = heads[0] if heads else None
    if row is None:
        return None
    sink = Sink.from_mapping(row, "s_")
    taken = [(r[0], r[1]) for r in locked]
    if row["c_id"] is None:
        return BeginHead(sink, row["db_now"], None, taken)
    cp = Checkpoint.from_mapping(row, "c_")
    if row["inserted"]:
        head = CheckpointHead(cp, None, list(row["open_attempt_ids"] or ()), list(row["unfinished_ids"] or ()), [])
    else:
        head = _existing_checkpoint_head(conn, sink, cp)
    return BeginHead(sink, row["db_now"], head, taken)


def _existing_checkpoint_head(conn: Connection, sink: Sink, cp: Checkpoint) -> CheckpointHead:
    reads = _BEGIN_READS.one(conn, {
        "sink_id": sink.id, "checkpoint_id": cp.id, "current_attempt": cp.current_attempt,
    })
    return CheckpointHead(
        cp,
        Attempt.from_mapping(reads, "a_") if reads["a_id"] is not None else None,
        list(reads["open_attempt_ids"] or ()),
        list(reads["unfinished_ids"] or ()),
        [EndedLease(int(a), LeaseState(s), t) for a, s, t in (reads["ended_leases"] or ())],
    )


# A new attempt with its first tries' leases, in one statement: the attempt with its first tries
# on its row (the i-th id to partition i; ids locked by the caller's take_free_transactional_ids),
# the checkpoint's current attempt, and those ids handed to their leases (first_try_lease_id; found
# by their unique transactional_id). No lease row and no event: the attempt row (started_at) is the
# record of a plain begin; the batch's one event is its decision.
_NEW_ATTEMPT = DriverStatement(f"""
WITH a AS (
    INSERT INTO attempts (checkpoint_id, sink_id, number, generation, state, partitions, started_at,
                          first_tids, first_deadline_at)
    VALUES (:checkpoint_id, :sink_id, :number, :generation, 'OPEN', :partitions, :now,
            CAST(:tids AS varchar(255)[]), :deadline_at)
    RETURNING *
), c AS (
    UPDATE checkpoints SET current_attempt = :number WHERE id = :checkpoint_id RETURNING id
), t AS (
    UPDATE transactional_ids AS t SET state = 'LEASED', lease_id = {FIRST_TRY_ID_BASE} + a.id * {FIRST_TRY_ID_STRIDE} + v.n - 1
    FROM a, unnest(CAST(:tids AS text[])) WITH ORDINALITY AS v(tid, n)
    WHERE t.transactional_id = v.tid AND t.state = 'FREE'
    RETURNING t.id
)
SELECT {_cols(attempt_columns, 'a', 'a_')}, clock_timestamp() AS db_now,
    coordinator_assert((SELECT count(*) FROM c) = 1 AND (SELECT count(*) FROM t) = :ids_taken,
                       'the checkpoint or a taken id changed under the locks of begin') AS checked
FROM a
""", generic_plan=True)


class NewAttempt(NamedTuple):
    attempt: Attempt
    leases: list[Lease]
    answered_at: datetime  # the database's clock once everything was written


def insert_attempt_with_leases(
    conn: Connection, *, sink: Sink, checkpoint_id: int, number: int, generation: int, partitions: int | None,
    now: datetime, taken: Sequence[tuple[int, str]], deadline_at: datetime, commit: bool = False,
) -> NewAttempt:
    """With `commit`, the transaction commits with this statement (its last)."""
    if taken:
        require_transition(TransactionalIdState.FREE, TransactionalIdState.LEASED)
    tids = [tid for _, tid in taken]
    (row,) = _NEW_ATTEMPT.rows(conn, {
        "checkpoint_id": checkpoint_id, "sink_id": sink.id, "number": number, "generation": generation,
        "partitions": partitions, "now": now, "tids": text_array(tids) if tids else None,
        "deadline_at": deadline_at if tids else None, "ids_taken": len(tids),
    }, commit=commit)
    attempt = Attempt.from_mapping(row, "a_")
    return NewAttempt(attempt, open_first_tries(sink.id, attempt, tids, deadline_at), row["db_now"])


def open_first_tries(sink_id: int, attempt: Attempt, tids: Sequence[str], deadline_at: datetime) -> list[Lease]:
    """The first tries on an OPEN attempt's row as leases (LEASED, no record yet), as the view
    first_try_leases shows them: the i-th id to partition i."""
    if not tids:
        return []
    first = Lease.from_fields(
        id=first_try_lease_id(attempt.id, 0), sink_id=sink_id, checkpoint_id=attempt.checkpoint_id,
        attempt_id=attempt.id, partition=0, task_attempt_id=FIRST_TRY_TASK_ATTEMPT,
        transactional_id=tids[0], state=LeaseState.LEASED, leased_at=attempt.started_at, deadline_at=deadline_at,
        producer_id=None, producer_epoch=None, records=None, bytes=None, precommitted_at=None, resolved_at=None,
        write_ms=None, first_offsets=None,
    )
    return first.variants(("id", "partition", "transactional_id"),
                          ((first.id + p, p, tid) for p, tid in enumerate(tids)))  # = first_try_lease_id(.., p)


# A new batch's whole begin in one statement, for the common case: the sink takes batches of this
# generation, the batch has no checkpoint yet, no attempt of the sink is OPEN, and its pool has a
# FREE id for every partition. Then it creates the checkpoint (its current attempt already the
# first), the attempt with its first tries on its row and their ids leased to them, as begin_head,
# the pool's query and _NEW_ATTEMPT do in two round trips; and it commits with it. Otherwise it
# writes nothing (the pool's ids it locked are released as its transaction commits) and the
# caller runs those instead, which make every refusal and take every other path. The guard
# restates what the service's rules ask of that path (check_generation, check_not_halted, a live
# sink with a query bound, decide_begin's NEW_ATTEMPT for a new checkpoint, no open attempt to
# abort first, no pool growth); the conditions are read from the statement's snapshot, as
# begin_head reads them for a new checkpoint. A concurrent begin of the same batch that inserts
# its checkpoint first makes the insert do nothing. The ids are taken as the pool's query takes
# them (FREE, out of quarantine, least recently released first, skipping locked ones) and the
# i-th goes to partition i; the times are the statement's clock as it starts (or the caller's).
_BEGIN_NEW_BATCH = DriverStatement(f"""
WITH s AS MATERIALIZED (
    SELECT *, clock_timestamp() AS db_now FROM sinks WHERE name = :name
), ok AS MATERIALIZED (
    SELECT s.id, s.lineage_query_id, COALESCE(CAST(:now AS timestamptz), s.db_now) AS now,
        COALESCE(CAST(:now AS timestamptz), transaction_timestamp()) AS pool_now, s.transaction_timeout_ms
    FROM s
    WHERE s.retired_at IS NULL AND s.lineage_query_id IS NOT NULL AND s.halted_at IS NULL
    AND s.generation = :generation
    AND NOT EXISTS (SELECT 1 FROM checkpoints AS e
                    WHERE e.sink_id = s.id AND e.query_id = s.lineage_query_id AND e.batch_id = :batch_id)
    AND NOT EXISTS (SELECT 1 FROM attempts AS o WHERE o.sink_id = s.id AND o.state = 'OPEN' AND o.finished_at IS NULL)
), ids AS MATERIALIZED (
    SELECT t.transactional_id, t.released_at, t.ordinal FROM transactional_ids AS t
    WHERE t.sink_id = (SELECT id FROM ok) AND t.state = 'FREE'
    AND (t.reusable_at IS NULL OR t.reusable_at <= (SELECT pool_now FROM ok))
    ORDER BY t.released_at, t.ordinal
    LIMIT :partitions
    FOR UPDATE SKIP LOCKED
), picked AS MATERIALIZED (
    SELECT array_agg(transactional_id ORDER BY released_at, ordinal) AS tids FROM ids
), c AS (
    INSERT INTO checkpoints (sink_id, query_id, batch_id, state, current_attempt, created_at, offsets_digest)
    SELECT ok.id, ok.lineage_query_id, :batch_id, 'OPEN', 1, ok.now, :offsets_digest
    FROM ok, picked WHERE cardinality(picked.tids) = :partitions
    ON CONFLICT (sink_id, query_id, batch_id) DO NOTHING
    RETURNING *
), a AS (
    INSERT INTO attempts (checkpoint_id, sink_id, number, generation, state, partitions, started_at,
                          first_tids, first_deadline_at)
    SELECT c.id, c.sink_id, 1, :generation, 'OPEN', :partitions, ok.now, CAST(picked.tids AS varchar(255)[]),
           ok.now + ok.transaction_timeout_ms * interval '1 millisecond'
    FROM c, ok, picked
    RETURNING *
), t AS (
    UPDATE transactional_ids AS t SET state = 'LEASED', lease_id = {FIRST_TRY_ID_BASE} + a.id * {FIRST_TRY_ID_STRIDE} + v.n - 1
    FROM a, unnest(a.first_tids) WITH ORDINALITY AS v(tid, n)
    WHERE t.transactional_id = v.tid AND t.state = 'FREE'
    RETURNING t.id
)
SELECT {_cols(sinks, 's', 's_')}, {_cols(checkpoints, 'c', 'c_')}, {_cols(attempt_columns, 'a', 'a_')},
    a.first_tids, a.first_deadline_at,
    (SELECT array_agg(u.id ORDER BY u.id) FROM checkpoints AS u
     WHERE u.sink_id = s.id AND u.state = 'COMMITTING') AS unfinished_ids,
    clock_timestamp() AS answered_at,
    coordinator_assert((SELECT count(*) FROM t) = CASE WHEN EXISTS (SELECT 1 FROM a) THEN :partitions ELSE 0 END,
                       'an id taken by the new batch changed under its lock') AS checked
FROM s LEFT JOIN (c CROSS JOIN a) ON true
""", generic_plan=True)


class NewBatch(NamedTuple):
    sink: Sink
    checkpoint: Checkpoint
    made: NewAttempt
    unfinished_ids: list[int]  # decided commits of the sink's other batches, still to finish


def begin_new_batch(
    conn: Connection, *, name: str, batch_id: int, generation: int, partitions: int, now: datetime | None,
    offsets_digest: str | None,
) -> NewBatch | None:
    """A new batch's begin in one round trip, committed with it; None when it is not that common
    case (then nothing was written, and the transaction is committed). `now`: the time to write,
    or None for the database's clock."""
    if transaction_started(conn):
        raise ValueError("a new batch's begin is a transaction of its own")
    if partitions < 1:
        raise ValueError("a new batch's begin takes the first tries of at least one partition")
    require_transition(TransactionalIdState.FREE, TransactionalIdState.LEASED)
    rows = _BEGIN_NEW_BATCH.rows(conn, {
        "name": name, "batch_id": batch_id, "generation": generation, "partitions": partitions, "now": now,
        "offsets_digest": offsets_digest,
    }, commit=True)
    if not rows or rows[0]["a_id"] is None:
        return None
    row = rows[0]
    sink, attempt = Sink.from_mapping(row, "s_"), Attempt.from_mapping(row, "a_")
    leases = open_first_tries(sink.id, attempt, row["first_tids"], row["first_deadline_at"])
    return NewBatch(sink, Checkpoint.from_mapping(row, "c_"), NewAttempt(attempt, leases, row["answered_at"]),
                    list(row["unfinished_ids"] or ()))


# --- commit: the decision -----------------------------------------------------------------------


# The sink (FOR SHARE), the checkpoint and the attempt (FOR UPDATE) of a commit, locked in that
# order (the lock order of repo's docstring: LockRows takes them in the order named here), with the
# attempt's first tries if they are on its row, and the database's clock read after the locks (the
# outer SELECT evaluates clock_timestamp() for a row only once the CTE has locked it). A row
# locked after a wait is its latest version, so first tries seen on the row are the attempt's only
# leases: any other lease of it is written after moving them to lease_rows (materialize_first_tries),
# under the attempt's lock that this statement now holds. The first tries' decision starts the same.
_LOCK_COMMIT_HEAD = f"""
    SELECT {_cols(sinks, 's', 's_')}, {_cols(checkpoints, 'c', 'c_')}, {_cols(attempt_columns, 'a', 'a_')},
        a.first_tids, a.first_deadline_at
    FROM sinks AS s
    JOIN checkpoints AS c ON c.sink_id = s.id AND c.query_id = s.lineage_query_id AND c.batch_id = :batch_id
    JOIN attempts AS a ON a.checkpoint_id = c.id AND a.number = :number
    WHERE s.name = :name
    FOR SHARE OF s FOR UPDATE OF c, a"""
_COMMIT_HEAD = DriverStatement(f"""
WITH h AS MATERIALIZED ({_LOCK_COMMIT_HEAD}
)
SELECT *, clock_timestamp() AS db_now FROM h
""")


class CommitHead(NamedTuple):
    sink: Sink
    checkpoint: Checkpoint
    attempt: Attempt
    first_tries: list[Lease] | None  # the OPEN attempt's first tries, on its row (then its only leases)
    db_now: datetime  # the database's clock, read after the locks


def commit_head(conn: Connection, name: str, batch_id: int, number: int) -> CommitHead | None:
    """Sink, checkpoint and attempt locked for a commit, or None if one of them is missing (the
    caller then reads them one by one, for the error that names what is missing)."""
    row = _COMMIT_HEAD.first(conn, {"name": name, "batch_id": batch_id, "number": number})
    if row is None:
        return None
    sink = Sink.from_mapping(row, "s_")
    if sink.retired_at is not None:
        return None
    attempt = Attempt.from_mapping(row, "a_")
    first_tries = None
    if row["first_tids"] is not None and attempt.state is AttemptState.OPEN:
        first_tries = open_first_tries(sink.id, attempt, row["first_tids"], row["first_deadline_at"])
    return CommitHead(sink, Checkpoint.from_mapping(row, "c_"), attempt, first_tries, row["db_now"])


# The attempt's leases, and the database's clock read after the locks, when commit_head found no
# first tries on the row: its lease rows locked (the outer SELECT evaluates clock_timestamp() for
# a row only once the CTE has locked it, so the last row's time is after every lock; the caller
# takes the latest), or its first tries still on its row (the caller holds the attempt's lock,
# which every writer of them takes). Not part of _COMMIT_HEAD's statement: a statement's snapshot
# is taken before its lock waits, so a retry's lease inserted by the transaction the attempt's
# lock waited for would be missed (and its transaction left open).
_LOCK_ATTEMPT_LEASES = DriverStatement(f"""
WITH l AS (SELECT * FROM lease_rows WHERE attempt_id = :attempt_id ORDER BY id FOR UPDATE)
SELECT {_names(lease_rows)}, false AS on_row, clock_timestamp() AS db_now FROM l
UNION ALL
SELECT {_names(lease_rows)}, true, clock_timestamp() FROM first_try_leases WHERE attempt_id = :attempt_id
ORDER BY id
""")


class AttemptLeases(NamedTuple):
    leases: list[Lease]
    on_row: bool  # the first tries are on the attempt's row (and it has no lease row)
    db_now: datetime | None


def lock_attempt_leases(conn: Connection, attempt_id: int) -> AttemptLeases:
    rows = _LOCK_ATTEMPT_LEASES.rows(conn, {"attempt_id": attempt_id})
    return AttemptLeases([Lease.from_mapping(r) for r in rows], any(r["on_row"] for r in rows),
                         max((r["db_now"] for r in rows), default=None))


# The decision: checkpoint and attempt OPEN -> COMMITTING, the winners whose pre-commit records
# came with the commit LEASED -> COMMITTING with the records, and the commit_decided event. The
# answer is the checkpoint and attempt's row, then the id and stored first offsets of each winner
# updated (FULL JOIN ON false): the caller holds the rest of each winner's row, locked.
# The winners are reached through their ids' array (`= ANY`, an index path of known size), whatever
# the statistics say of `state = 'LEASED'`: a table of history whose statistics show no LEASED lease
# made the plan of a join on the records scan every lease (12,000 leases: 379 buffers and 2.4 ms
# per two-partition decision, against 7 and 0.15 ms now). Their records come as one JSON object
# keyed by lease id, read once and looked up per lease, so no join is left for the planner to order
# (with the array, it put a scan of the records inside a loop over the leases: parsed once per
# lease).
_DECIDE = DriverStatement(f"""
WITH c AS (
    UPDATE checkpoints SET state = 'COMMITTING', decided_at = :now, committed_attempt = :number
    WHERE id = :checkpoint_id AND state = 'OPEN' RETURNING *
), a AS (
    UPDATE attempts SET state = 'COMMITTING', decided_at = :now, partitions = :partitions, job_ms = :job_ms
    WHERE id = :attempt_id AND state = 'OPEN' RETURNING *
), w AS (
    UPDATE lease_rows AS l SET state = 'COMMITTING',
        producer_id = CAST(r.doc -> CAST(l.id AS text) ->> 'producer_id' AS bigint),
        producer_epoch = CAST(r.doc -> CAST(l.id AS text) ->> 'producer_epoch' AS int),
        records = CAST(r.doc -> CAST(l.id AS text) ->> 'records' AS bigint),
        bytes = CAST(r.doc -> CAST(l.id AS text) ->> 'bytes' AS bigint),
        write_ms = CAST(r.doc -> CAST(l.id AS text) ->> 'write_ms' AS bigint),
        first_offsets = r.doc -> CAST(l.id AS text) ->> 'first_offsets',
        precommitted_at = :now
    FROM (SELECT CAST(:records AS jsonb) AS doc) AS r
    WHERE l.id = ANY(CAST(:ids AS bigint[])) AND l.state = 'LEASED'
    RETURNING l.*
), ev AS (
    INSERT INTO events (sink_id, checkpoint_id, at, kind, actor, detail)
    SELECT :sink_id, :checkpoint_id, :now, 'commit_decided', :actor, CAST(:detail AS jsonb) FROM c, a
)
SELECT {_cols(checkpoints, 'c', 'c_')}, {_cols(attempt_columns, 'a', 'a_')}, w.id AS w_id, w.first_offsets AS w_first_offsets
FROM c CROSS JOIN a FULL JOIN w ON false ORDER BY w.id NULLS FIRST
""")


def decide(
    conn: Connection, *, sink_id: int, checkpoint_id: int, attempt_id: int, number: int, partitions: int,
    job_ms: int | None, records: Sequence[tuple[Lease, PrecommitRecord]], now: datetime, actor: str,
    event_detail: dict[str, Any],
) -> tuple[Checkpoint, Attempt, list[Lease]]:
    """Returns the decided checkpoint and attempt and the record winners now COMMITTING (by id).
    Each winner's lease must be as the caller read it under its lock (LEASED): the statement
    changes only the fields the record sets, so the winners are built from those leases. For the
    leases of lease_rows: first tries on the attempt's row are decided by decide_first_tries."""
    require_transition(CheckpointState.OPEN, CheckpointState.COMMITTING)
    require_transition(AttemptState.OPEN, AttemptState.COMMITTING)
    if records:
        require_transition(LeaseState.LEASED, LeaseState.COMMITTING)
    rows = _DECIDE.rows(conn, {
        "checkpoint_id": checkpoint_id, "attempt_id": attempt_id, "sink_id": sink_id, "number": number,
        "partitions": partitions, "job_ms": job_ms, "now": now, "actor": actor, "detail": _json(event_detail),
        "ids": int_array([lease.id for lease, _ in records]),
        # one JSON document (encoded in C): a text[] of P JSON values costs psycopg a regex escape per quote
        "records": _json({
            lease.id: {"producer_id": r.producer_id, "producer_epoch": r.producer_epoch, "records": r.records,
                       "bytes": r.bytes, "write_ms": r.write_ms, "first_offsets": r.first_offsets}
            for lease, r in records
        }),
    })
    if not rows or rows[0]["c_id"] is None or rows[0]["a_id"] is None:
        raise AssertionError("the checkpoint or attempt changed state under the decision's locks")
    stored = {r["w_id"]: r["w_first_offsets"] for r in rows if r["w_id"] is not None}
    winners = [
        lease.with_changes(
            state=LeaseState.COMMITTING, producer_id=r.producer_id, producer_epoch=r.producer_epoch, records=r.records,
            bytes=r.bytes, write_ms=r.write_ms, first_offsets=stored[lease.id], precommitted_at=now,
        )
        for lease, r in records if lease.id in stored
    ]
    return Checkpoint.from_mapping(rows[0], "c_"), Attempt.from_mapping(rows[0], "a_"), winners


def decision_event_detail(batch_id: int, attempt: int, winners: Iterable[tuple[int, int]]) -> dict[str, Any]:
    """The commit_decided event's detail: the winners (partition, lease id) by partition, as parallel
    lists. Their transactional ids are on their lease rows or attempt row, which are kept."""
    by_partition = sorted(winners)
    return {"batch_id": batch_id, "attempt": attempt, "winners": {
        "partitions": [p for p, _ in by_partition], "lease_ids": [lease_id for _, lease_id in by_partition]}}


# --- commit: the decision of first tries on the attempt's row, with its locks ---------------------


class FirstTriesCommit(NamedTuple):
    """A commit of first tries on the attempt's row: partition i's result at index i, every lease
    it names the first try of partition i of the attempt (by its id's encoding), each with its
    record; the other first tries (empty partitions) end unused."""

    attempt_id: int
    records: list[PrecommitRecord | None]  # by first try's partition; None for an empty partition
    unused: list[int]  # the empty partitions' first tries, which end unused
    partitions: int  # the batch's partition count, as the driver reported it


def first_tries_commit(results: Sequence[PartitionResult], max_partitions: int) -> FirstTriesCommit | None:
    """The request as `decide_first_tries` takes it, or None when it is not of that shape or names
    no lease (the caller then takes the general path, which judges it whatever it is)."""
    if not results or len(results) > max_partitions:
        return None
    attempt_id = None
    records: list[PrecommitRecord | None] = []
    unused = []
    for i, r in enumerate(results):
        if r.partition != i:
            return None
        if r.lease_id is None:
            if r.precommit is not None:
                return None
            records.append(None)
            unused.append(i)
            continue
        if r.precommit is None:
            return None
        if attempt_id is None:
            attempt_id = attempt_of_first_try_id(r.lease_id)
            if attempt_id is None:
                return None
        if r.lease_id != first_try_lease_id(attempt_id, i):
            return None
        records.append(r.precommit)
    return None if attempt_id is None else FirstTriesCommit(attempt_id, records, unused, len(results))


# The decision of first tries on the attempt's row, with the locks of _COMMIT_HEAD and the clock
# read after them (or the caller's time), and its COMMIT: the checkpoint and attempt OPEN ->
# COMMITTING, the records on the attempt row (a JSON array by partition, null for an empty one:
# [producer_id, producer_epoch, records, bytes, write_ms, first_offsets], stored as the text this
# module encoded, unchecked: migration 0018), so its first tries with a record are COMMITTING and
# the others ABORTED, whose ids are free again at once (no producer ever used them); and the
# commit_decided event.
#
# It decides only when its guard holds, and otherwise writes nothing and answers the head as locked
# (or no row). The guard restates what the service's rules ask of this decision (check_generation,
# check_attempt_writable, plan_commit of first tries on the row that each won with its record or
# were left empty, check_commit_deadlines against the first tries' common deadline): a live sink of
# this generation, the checkpoint OPEN with this attempt current, the attempt the one the lease ids
# name, OPEN, of this generation, with as many first tries on its row as there are partitions, and
# their deadline at least the sink's margin away if any won. It reads them from the rows as locked:
# a row locked after a wait is its latest version, and first tries still on the attempt's row are
# its only leases (commit_head's reasoning). The commit call's common case sends it first, with
# BEGIN and COMMIT, as its whole transaction (one round trip, where head and decision took two)
# and runs the general path after it if it decided nothing; the service runs the rules on the head
# it answers, which must agree. The general path sends it last, once the rules have judged.
_DECIDE_FIRST_TRIES = DriverStatement(f"""
WITH h AS MATERIALIZED ({_LOCK_COMMIT_HEAD}
), hn AS MATERIALIZED (
    SELECT h.*, COALESCE(CAST(:now AS timestamptz), clock_timestamp()) AS db_now FROM h
), ok AS MATERIALIZED (
    SELECT hn.s_id, hn.c_id, hn.a_id, hn.first_tids, hn.db_now AS now FROM hn
    WHERE hn.s_retired_at IS NULL AND hn.s_generation = :generation
    AND hn.c_state = 'OPEN' AND hn.c_current_attempt = :number
    AND hn.a_id = :attempt_id AND hn.a_state = 'OPEN' AND hn.a_generation = :generation
    AND cardinality(hn.first_tids) = :first_tries
    AND (hn.first_deadline_at >= hn.db_now + hn.s_commit_margin_ms * interval '1 millisecond'
         OR cardinality(CAST(:unused AS int[])) = :first_tries)
), c AS (  -- each row by its id (a join with ok let the generic plan scan the OPEN checkpoints of every sink)
    UPDATE checkpoints SET state = 'COMMITTING', decided_at = (SELECT now FROM ok), committed_attempt = :number
    WHERE id = (SELECT c_id FROM ok) AND state = 'OPEN' RETURNING *
), a AS (
    UPDATE attempts SET state = 'COMMITTING', decided_at = (SELECT now FROM ok), partitions = :partitions,
        job_ms = :job_ms, first_records = :records
    WHERE id = (SELECT a_id FROM ok) AND state = 'OPEN' AND first_tids IS NOT NULL RETURNING *
), t AS (
    UPDATE transactional_ids AS t SET state = 'FREE', lease_id = NULL, released_at = (SELECT now FROM ok),
        reusable_at = NULL
    FROM ok CROSS JOIN unnest(CAST(:unused AS int[])) AS u(partition)
    WHERE t.transactional_id = ok.first_tids[u.partition + 1]
    AND t.lease_id = {FIRST_TRY_ID_BASE} + ok.a_id * {FIRST_TRY_ID_STRIDE} + u.partition AND t.state = 'LEASED'
    AND EXISTS (SELECT 1 FROM a)
    RETURNING t.id
), ev AS (
    INSERT INTO events (sink_id, checkpoint_id, at, kind, actor, detail)
    SELECT ok.s_id, ok.c_id, ok.now, 'commit_decided', :actor, CAST(:detail AS jsonb)
    FROM ok, c, a
)
SELECT hn.*, EXISTS (SELECT 1 FROM ok) AS decided,
    coordinator_assert(NOT EXISTS (SELECT 1 FROM ok) OR (
        (SELECT count(*) FROM c) = 1 AND (SELECT count(*) FROM a) = 1
        AND (SELECT count(*) FROM t) = cardinality(CAST(:unused AS int[]))),
        'the checkpoint, attempt or an id changed state under the locks of the decision') AS checked
FROM hn
""", generic_plan=True)


_WINNER_FIELDS = ("id", "partition", "transactional_id", "producer_id", "producer_epoch", "records", "bytes",
                  "write_ms", "first_offsets")


class FirstTriesDecided(NamedTuple):
    head: CommitHead  # as locked, before the decision (its first tries LEASED)
    checkpoint: Checkpoint  # decided
    attempt: Attempt  # decided
    winners: list[Lease]  # COMMITTING with their records, by partition
    unused: list[Lease]  # the empty partitions' first tries, ABORTED (their ids FREE again)


def decide_first_tries(
    conn: Connection, request: FirstTriesCommit, *, name: str, batch_id: int, number: int, generation: int,
    job_ms: int | None, now: datetime | None, actor: str,
) -> FirstTriesDecided | None:
    """The decision, when its guard holds, else None (nothing was written); either way the
    transaction commits with it (the caller's last statement, or its only one: then the whole
    transaction is one round trip). `now`: the time to judge and write, or None for the database's
    clock read after the locks."""
    require_transition(CheckpointState.OPEN, CheckpointState.COMMITTING)
    require_transition(AttemptState.OPEN, AttemptState.COMMITTING)
    require_transition(LeaseState.LEASED, LeaseState.COMMITTING)
    if request.unused:
        require_transition(LeaseState.LEASED, LeaseState.ABORTED)
        require_transition(TransactionalIdState.LEASED, TransactionalIdState.FREE)
    # each record encoded once, as its array on the attempt row: the row's document joins them,
    # and a winner's first offsets are that text after its fifth comma (the five values before
    # are numbers or null), as the views read them back
    record_texts = [None if r is None else _json([r.producer_id, r.producer_epoch, r.records, r.bytes, r.write_ms,
                                                  r.first_offsets]) for r in request.records]
    rows = _DECIDE_FIRST_TRIES.rows(conn, {
        "name": name, "batch_id": batch_id, "number": number, "generation": generation, "now": now,
        "attempt_id": request.attempt_id, "first_tries": len(request.records), "partitions": request.partitions,
        "job_ms": job_ms, "actor": actor,
        "records": "[" + ",".join(["null" if text is None else text for text in record_texts]) + "]",
        "unused": int_array(request.unused),
        "detail": _json(decision_event_detail(batch_id, number, (
            (p, first_try_lease_id(request.attempt_id, p)) for p, r in enumerate(request.records) if r is not None))),
    }, commit=True)
    if not rows or not rows[0]["decided"]:
        return None
    row = rows[0]
    # the head as locked; the decided rows are it with what the statement wrote
    sink, checkpoint, attempt = Sink.from_mapping(row, "s_"), Checkpoint.from_mapping(row, "c_"), Attempt.from_mapping(row, "a_")
    decided_at = row["db_now"]
    first_tries = open_first_tries(sink.id, attempt, row["first_tids"], row["first_deadline_at"])
    head = CommitHead(sink, checkpoint, attempt, first_tries, decided_at)
    # the first tries differ only in their id, partition and transactional id (open_first_tries),
    # so the winners are copies of one COMMITTING lease with those and their records' fields set
    committing = first_tries[0].with_changes(state=LeaseState.COMMITTING, precommitted_at=decided_at)
    winners = committing.variants(_WINNER_FIELDS, [
        (lease.id, lease.partition, lease.transactional_id, r.producer_id, r.producer_epoch, r.records, r.bytes,
         r.write_ms, None if r.first_offsets is None else text.split(",", 5)[5][:-1])
        for lease, r, text in zip(first_tries, request.records, record_texts) if r is not None
    ])
    unused = Lease.all_with_changes((first_tries[p] for p in request.unused), state=LeaseState.ABORTED,
                                    resolved_at=decided_at)
    return FirstTriesDecided(
        head,
        checkpoint.with_changes(state=CheckpointState.COMMITTING, decided_at=decided_at, committed_attempt=number),
        attempt.with_changes(state=AttemptState.COMMITTING, decided_at=decided_at, partitions=request.partitions,
                             job_ms=job_ms),
        winners, unused)


# --- commit: marking it committed after Kafka ---------------------------------------------------


# The mark is two statements sent in one round trip with their transaction's BEGIN and COMMIT
# (driver_sql.run_together): the checkpoint locked, then the mark, whose snapshot is taken once
# the lock is granted (a statement's snapshot is taken before its own lock waits, so one statement
# could not do both: it would miss what a concurrent finisher committed). The mark reads the
# checkpoint's state under that lock itself, so nothing waits for the lock's answer.
#
# The mark's transaction commits asynchronously (synchronous_commit off for it alone): it records
# what Kafka already holds, so losing it in a Postgres crash leaves the decision COMMITTING, and
# whoever finds it (recovery, the next begin, a resume) commits again on Kafka, which answers a
# completed commit as success. That is the state a coordinator crash between Kafka's commit and
# the mark leaves too. Any later synchronous commit (the next begin, decision) flushes the WAL up
# to it, so nothing that depends on it (an id it freed, leased again) outlives a crash without it.
# The decision and the leases stay synchronous: they are the durable facts (docs/design.md, step 5).
_LOCK_CHECKPOINT_FOR_MARK = DriverStatement(
    f"SELECT {_names(checkpoints)}, set_config('synchronous_commit', 'off', true) AS synchronous_commit "
    "FROM checkpoints WHERE id = :checkpoint_id FOR UPDATE"
)


# Winners Kafka committed: COMMITTING -> COMMITTED, their ids FREE again at once; and, when the
# checkpoint is COMMITTING under the lock the statement before took (`k.finish`), the attempt and
# checkpoint COMMITTING -> COMMITTED in the same statement if no other winner of the attempt is
# still COMMITTING. That guard restates the service's rule so the mark costs no round trip of its
# own; the statement checks (coordinator_assert) that the checkpoint was marked if and only if
# `finish` and no winner of the attempt is left COMMITTING, since it commits with its transaction.
# Winners that are first tries on the attempt's row are COMMITTED by the attempt's own mark (they
# are all of its winners: any other kind of commit materialised them first), and their ids are
# freed only with it. The first tries on the row are read once, from the records' document (`r`:
# whether each won, whether `done` names it): through the view `leases` the guard and the answer
# each built them from that document (at 200 partitions the mark took 4.1-4.6 ms, against 3.4-3.5
# with one pass; bench/statement_times.py). The answer reads them through the view only when one
# is left out of `done` (an empty partition's, or a winner left COMMITTING, which the check of the
# answer must see).
# With `:event_actor`, the mark also records a checkpoint_committed event. The
# time it writes is the caller's, or the database's clock as the statement starts (after the
# lock). The answer is the marked checkpoint and attempt's row (if marked), then the id of each
# lease row this statement marked, then every other lease of the checkpoint as the statement's
# snapshot shows it (FULL JOIN ON false; not the first tries on the row this marked, which the
# caller holds). The ids are found by the two sets, not joined pair by pair: a join's plan trusts
# the statistics of `state = 'LEASED'` (almost no row, after an ANALYZE), and with 40,000 ids of
# other sinks it scanned them all and re-read the pairs once per id (a 200-partition mark:
# 17.7 ms, against 6.7 then). The sets match the pairs: each done lease names its id, and that
# id, held for an unresolved lease, cannot have been freed and leased to another.
_MARK_COMMITTED = DriverStatement(f"""
WITH n AS MATERIALIZED (
    SELECT COALESCE(CAST(:now AS timestamptz), clock_timestamp()) AS now
), k AS MATERIALIZED (
    SELECT state = 'COMMITTING' AS finish FROM checkpoints WHERE id = :checkpoint_id
), r AS MATERIALIZED (
    SELECT json_typeof(f.rec) <> 'null' AS won, d.id IS NOT NULL AS named
    FROM attempts AS fa
    CROSS JOIN LATERAL json_array_elements(CAST(fa.first_records AS json)) WITH ORDINALITY AS f(rec, n)
    LEFT JOIN unnest(CAST(:done AS bigint[])) AS d(id) ON d.id = {FIRST_TRY_ID_BASE} + fa.id * {FIRST_TRY_ID_STRIDE} + f.n - 1
    WHERE fa.id = :attempt_id AND fa.first_tids IS NOT NULL
), u AS (
    UPDATE lease_rows SET state = 'COMMITTED', resolved_at = (SELECT now FROM n)
    WHERE id = ANY(CAST(:done AS bigint[])) AND state = 'COMMITTING' RETURNING *
), a AS (
    UPDATE attempts SET state = 'COMMITTED', finished_at = (SELECT now FROM n)
    WHERE id = :attempt_id AND state = 'COMMITTING' AND (SELECT finish FROM k)
    AND NOT EXISTS (SELECT 1 FROM lease_rows WHERE attempt_id = :attempt_id AND state = 'COMMITTING'
                    AND id <> ALL(CAST(:done AS bigint[])))
    AND NOT EXISTS (SELECT 1 FROM r WHERE r.won AND NOT r.named)
    RETURNING *
), t AS (
    UPDATE transactional_ids AS t SET state = 'FREE', lease_id = NULL, released_at = (SELECT now FROM n),
        reusable_at = NULL
    WHERE t.transactional_id = ANY(CAST(:done_ids AS text[])) AND t.lease_id = ANY(CAST(:done AS bigint[]))
    AND t.state = 'LEASED' AND (t.lease_id IN (SELECT id FROM u) OR EXISTS (SELECT 1 FROM a))
), c AS (
    UPDATE checkpoints SET state = 'COMMITTED', committed_at = (SELECT now FROM n)
    WHERE id = :checkpoint_id AND state = 'COMMITTING' AND EXISTS (SELECT 1 FROM a)
    RETURNING *
), ev AS (
    INSERT INTO events (sink_id, checkpoint_id, at, kind, actor, detail)
    SELECT :sink_id, :checkpoint_id, (SELECT now FROM n), 'checkpoint_committed', CAST(:event_actor AS text),
           CAST(:detail AS jsonb) FROM a, c
    WHERE CAST(:event_actor AS text) IS NOT NULL
), x AS (
    SELECT {_names(lease_rows)} FROM lease_rows WHERE checkpoint_id = :checkpoint_id AND id NOT IN (SELECT id FROM u)
    UNION ALL
    SELECT {_names(lease_rows)} FROM first_try_leases WHERE checkpoint_id = :checkpoint_id AND attempt_id <> :attempt_id
    UNION ALL
    SELECT {_names(lease_rows)} FROM first_try_leases WHERE attempt_id = :attempt_id AND NOT EXISTS (SELECT 1 FROM a)
    UNION ALL
    SELECT {_names(lease_rows)} FROM first_try_leases WHERE attempt_id = :attempt_id AND EXISTS (SELECT 1 FROM a)
    AND EXISTS (SELECT 1 FROM r WHERE NOT r.named) AND id <> ALL(CAST(:done AS bigint[]))
)
SELECT {_cols(checkpoints, 'c', 'c_')}, {_cols(attempt_columns, 'a', 'a_')}, u.id AS u_id, {_cols(leases, 'x', 'x_')},
    checked.now AS mark_now
FROM (SELECT (SELECT now FROM n) AS now, coordinator_assert(
    (SELECT count(*) FROM c) = CASE WHEN (SELECT finish FROM k) AND NOT EXISTS (
        SELECT 1 FROM x WHERE x.attempt_id = :attempt_id AND x.state = 'COMMITTING') THEN 1 ELSE 0 END,
    'the checkpoint or attempt changed state under the lock of the checkpoint')) AS checked
LEFT JOIN ((c CROSS JOIN a) FULL JOIN (SELECT id FROM u) AS u ON false FULL JOIN x ON false) ON true
ORDER BY COALESCE(u.id, x.id) NULLS FIRST
""")


# The committed mark of the common path, sent with the same lock (one round trip): the commit call
# that decided marks its own decision, whose winners are all first tries on the attempt's row. The
# caller names them all (`done`) and the rest of the row's first tries, which the decision ended
# unused (`unused`), so the answer needs no read of the row: every lease of the checkpoint is one of
# those, which the guard makes sure of: the checkpoint COMMITTING under the lock, the attempt
# COMMITTING with as many first tries on its row as the two lists name, no lease row in the
# checkpoint and no other attempt's first tries. When the guard does not hold (another finisher
# marked first, a retry's lease was written) nothing changes and the caller runs the general mark
# above. It reads neither the records' document nor the views: at 2 partitions ~0.35-0.55 ms of
# execution against ~0.65-1.0 for the general mark, at 200 ~1.2 against ~3.0 (EXPLAIN ANALYZE).
# It runs its generic plan: on a database with a history Postgres planned it anew at every run,
# which cost more than the statement saved (bench/README.md, nineteenth round). The commit call
# writes no event for its mark (its decision's event and the checkpoint row are the record).
_MARK_FIRST_TRIES_COMMITTED = DriverStatement(f"""
WITH n AS MATERIALIZED (
    SELECT COALESCE(CAST(:now AS timestamptz), clock_timestamp()) AS now
), a AS (
    UPDATE attempts AS a SET state = 'COMMITTED', finished_at = (SELECT now FROM n)
    FROM checkpoints AS k
    WHERE a.id = :attempt_id AND a.checkpoint_id = k.id AND a.state = 'COMMITTING'
    AND cardinality(a.first_tids) = :first_tries
    AND k.id = :checkpoint_id AND k.state = 'COMMITTING'
    AND NOT EXISTS (SELECT 1 FROM lease_rows WHERE checkpoint_id = :checkpoint_id)
    AND NOT EXISTS (SELECT 1 FROM attempts AS o WHERE o.checkpoint_id = :checkpoint_id AND o.id <> :attempt_id
                    AND o.first_tids IS NOT NULL)
    RETURNING a.*
), t AS (
    UPDATE transactional_ids AS t SET state = 'FREE', lease_id = NULL, released_at = (SELECT now FROM n),
        reusable_at = NULL
    WHERE t.transactional_id = ANY(CAST(:done_ids AS text[])) AND t.lease_id = ANY(CAST(:done AS bigint[]))
    AND t.state = 'LEASED' AND EXISTS (SELECT 1 FROM a)
    RETURNING t.id
), c AS (
    UPDATE checkpoints SET state = 'COMMITTED', committed_at = (SELECT now FROM n)
    WHERE id = :checkpoint_id AND state = 'COMMITTING' AND EXISTS (SELECT 1 FROM a)
    RETURNING *
)
SELECT {_cols(checkpoints, 'c', 'c_')}, {_cols(attempt_columns, 'a', 'a_')}, checked.now AS mark_now
FROM (SELECT (SELECT now FROM n) AS now, coordinator_assert(
    (SELECT count(*) FROM c) = (SELECT count(*) FROM a)
    AND (SELECT count(*) FROM t) = CASE WHEN EXISTS (SELECT 1 FROM a) THEN :done_count ELSE 0 END,
    'the checkpoint, attempt or an id changed state under the lock of the checkpoint')) AS checked
LEFT JOIN (c CROSS JOIN a) ON true
""", generic_plan=True)


class MarkedCommitted(NamedTuple):
    checkpoint: Checkpoint  # as found under its lock, before the mark
    leases: list[Lease]  # every lease of the checkpoint, after the change
    marked: tuple[Checkpoint, Attempt] | None  # the checkpoint and attempt if this marked them COMMITTED
    now: datetime  # the time the mark wrote


def mark_committed(
    conn: Connection, *, sink_id: int, checkpoint_id: int, attempt_id: int, done: Sequence[Lease],
    now: datetime | None, event_actor: str | None, event_detail: dict[str, Any],
) -> MarkedCommitted:
    """Winners `done` (COMMITTING leases, as read) committed, and the checkpoint too if it is
    COMMITTING under its lock and none of its winners is left COMMITTING, in a transaction of its
    own: conn's must not have begun, and is committed when this returns. With `event_actor`, that
    mark also records a checkpoint_committed event (a commit finished after its decision's call,
    e.g. by recovery); without, the checkpoint row (committed_at) is the record. A COMMITTING lease
    changes no field but its state until it ends, so a winner this marks is its lease as read, now
    COMMITTED; one another finisher marked first comes back as it is. `now`: the time to write, or
    None for the database's clock after the lock."""
    require_transition(LeaseState.COMMITTING, LeaseState.COMMITTED)
    require_transition(TransactionalIdState.LEASED, TransactionalIdState.FREE)
    require_transition(AttemptState.COMMITTING, AttemptState.COMMITTED)
    require_transition(CheckpointState.COMMITTING, CheckpointState.COMMITTED)
    if transaction_started(conn):  # its synchronous_commit would apply to what came before
        raise ValueError("the committed mark is a transaction of its own")
    (locked,), rows = run_together(conn, (
        (_LOCK_CHECKPOINT_FOR_MARK, {"checkpoint_id": checkpoint_id}),
        (_MARK_COMMITTED, {
            "sink_id": sink_id, "checkpoint_id": checkpoint_id, "attempt_id": attempt_id,
            "done": int_array([x.id for x in done]),
            "done_ids": text_array([x.transactional_id for x in done]),  # a lease's id never changes: no join to leases
            "now": now, "event_actor": event_actor, "detail": _json(event_detail),
        }),
    ), commit=True)
    if now is None:
        now = rows[0]["mark_now"]
    marked = None
    if rows[0]["c_id"] is not None:
        marked = Checkpoint.from_mapping(rows[0], "c_"), Attempt.from_mapping(rows[0], "a_")
    by_id = {x.id: x for x in done}
    after = [
        by_id[r["u_id"]].with_changes(state=LeaseState.COMMITTED, resolved_at=now) if r["u_id"] is not None
        else Lease.from_mapping(r, "x_")
        for r in rows if r["u_id"] is not None or r["x_id"] is not None
    ]
    if marked is not None:  # the first tries on the attempt's row were committed with it
        answered = {x.id for x in after}
        on_row = Lease.all_with_changes((x for x in done if x.id not in answered), state=LeaseState.COMMITTED,
                                        resolved_at=now)
        if on_row:
            after = sorted(after + on_row, key=lambda x: x.id)
    return MarkedCommitted(Checkpoint.from_mapping(locked), after, marked, now)


def mark_first_tries_committed(
    conn: Connection, *, checkpoint_id: int, attempt_id: int, done: Sequence[Lease], unused: Sequence[Lease],
    now: datetime | None,
) -> MarkedCommitted | None:
    """mark_committed for the commit call that decided, when every winner is a first try on the
    attempt's row: `done` all of them (COMMITTING, as read), `unused` the row's other first tries
    as the decision ended them (ABORTED). None when the checkpoint's leases are not just those, or
    the checkpoint is no longer COMMITTING under its lock: then nothing changed (the transaction
    committed empty) and the caller runs mark_committed in a transaction of its own."""
    require_transition(LeaseState.COMMITTING, LeaseState.COMMITTED)
    require_transition(TransactionalIdState.LEASED, TransactionalIdState.FREE)
    require_transition(AttemptState.COMMITTING, AttemptState.COMMITTED)
    require_transition(CheckpointState.COMMITTING, CheckpointState.COMMITTED)
    if transaction_started(conn):
        raise ValueError("the committed mark is a transaction of its own")
    if not done or any(x.attempt_id != attempt_id or x.task_attempt_id != FIRST_TRY_TASK_ATTEMPT
                       for x in (*done, *unused)):
        raise ValueError("only an attempt's own first tries, with at least one winner, are marked here")
    if any(x.state is not LeaseState.COMMITTING for x in done) or any(x.state is not LeaseState.ABORTED for x in unused):
        raise ValueError("the winners must be COMMITTING and the unused first tries ABORTED")
    (locked,), rows = run_together(conn, (
        (_LOCK_CHECKPOINT_FOR_MARK, {"checkpoint_id": checkpoint_id}),
        (_MARK_FIRST_TRIES_COMMITTED, {
            "checkpoint_id": checkpoint_id, "attempt_id": attempt_id, "first_tries": len(done) + len(unused),
            "done": int_array([x.id for x in done]), "done_ids": text_array([x.transactional_id for x in done]),
            "done_count": len(done), "now": now,
        }),
    ), commit=True)
    row = rows[0]
    if row["c_id"] is None:
        return None
    now = row["mark_now"]
    leases = Lease.all_with_changes(done, state=LeaseState.COMMITTED, resolved_at=now) + list(unused)
    leases.sort(key=lambda x: x.id)
    return MarkedCommitted(Checkpoint.from_mapping(locked), leases,
                           (Checkpoint.from_mapping(row, "c_"), Attempt.from_mapping(row, "a_")), now)
