"""Checkpoints (one per batch of a sink's query) and their attempts: reads, inserts and the
compare-and-set moves of their states."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, and_, bindparam, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ..protocol import errors as e
from ..protocol.model import Attempt, Checkpoint, Sink
from ..protocol.states import AttemptState, CheckpointState, require_transition
from .sinks import Lock, refuse_retired, sink_by_name
from .tables import attempts, checkpoints, sinks


@dataclass(frozen=True)
class AttemptRows:
    """An attempt with its batch's checkpoint and its sink, as one read locked them."""

    sink: Sink
    checkpoint: Checkpoint
    attempt: Attempt


def _attempt_rows(of_batch: str) -> Any:
    return (select(sinks, checkpoints, attempts)
            .join_from(sinks, checkpoints, and_(checkpoints.c.sink_id == sinks.c.id,
                                                checkpoints.c.query_id == sinks.c.lineage_query_id))
            .join(attempts, and_(attempts.c.checkpoint_id == checkpoints.c.id, attempts.c.number == bindparam("number")))
            .where(sinks.c.name == bindparam("name"), checkpoints.c.batch_id == bindparam("batch_id"))
            .with_for_update(read=True, of=sinks).suffix_with(of_batch))


# built once: the protocol's calls run them for every batch and partition
_ATTEMPT_ROWS = {"share": _attempt_rows("FOR SHARE OF checkpoints, attempts"),
                 "update": _attempt_rows("FOR UPDATE OF checkpoints, attempts")}


def attempt_rows(conn: Connection, name: str, batch_id: int, number: int, *, lock: Lock) -> AttemptRows:
    """The sink (FOR SHARE), the batch of its current lineage and the batch's attempt `number` (both
    locked `lock`), in one statement; the locks are taken in the lock order (sinks.py). A row that
    is not there is reported as the per-row reads report it (unknown sink, batch or attempt); a
    retired sink is refused."""
    assert lock is not None
    row = conn.execute(_ATTEMPT_ROWS[lock], dict(name=name, batch_id=batch_id, number=number)).first()
    if row is None:  # say which one is missing
        sink = sink_by_name(conn, name)
        attempt_of(conn, checkpoint_for(conn, sink, batch_id), number)
        raise AssertionError("the attempt's rows appeared between two reads of one transaction")
    rows = AttemptRows(*(cls.from_mapping({c.name: row._mapping[c] for c in table.c})
                         for cls, table in ((Sink, sinks), (Checkpoint, checkpoints), (Attempt, attempts))))
    refuse_retired(rows.sink)
    return rows


_CHECKPOINT_FOR = select(checkpoints).where(checkpoints.c.sink_id == bindparam("sink_id"),
                                            checkpoints.c.batch_id == bindparam("batch_id"),
                                            checkpoints.c.query_id == bindparam("query_id"))
_CHECKPOINT_BY_ID = select(checkpoints).where(checkpoints.c.id == bindparam("checkpoint_id"))
_LOCKED = {stmt: stmt.with_for_update() for stmt in (_CHECKPOINT_FOR, _CHECKPOINT_BY_ID)}


def checkpoint_for(conn: Connection, sink: Sink, batch_id: int, *, lock: bool = False) -> Checkpoint:
    """The batch of the sink's current lineage (404 if it was never begun)."""
    row = conn.execute(_LOCKED[_CHECKPOINT_FOR] if lock else _CHECKPOINT_FOR,
                       dict(sink_id=sink.id, batch_id=batch_id, query_id=sink.lineage_query_id or "")).first()
    if row is None:
        raise e.NotFound("unknown_checkpoint", f"batch {batch_id} of sink {sink.name!r} was never begun",
                         batch_id=batch_id)
    return Checkpoint.from_mapping(row._mapping)


def checkpoint_by_id(conn: Connection, checkpoint_id: int, *, lock: bool = False) -> Checkpoint:
    stmt = _LOCKED[_CHECKPOINT_BY_ID] if lock else _CHECKPOINT_BY_ID
    return Checkpoint.from_mapping(conn.execute(stmt, dict(checkpoint_id=checkpoint_id)).one()._mapping)


def checkpoint_begun(conn: Connection, sink: Sink, batch_id: int, now: datetime,
                     digest: str | None) -> tuple[Checkpoint, bool]:
    """The batch's checkpoint, created OPEN (bound to `digest`) if it is new, locked FOR UPDATE;
    and whether it was new."""
    assert sink.lineage_query_id is not None
    created = conn.execute(_BEGIN_CHECKPOINT, dict(
        sink_id=sink.id, query_id=sink.lineage_query_id, batch_id=batch_id, state=CheckpointState.OPEN.value,
        created_at=now, offsets_digest=digest,
    )).first()
    if created is not None:  # a row this transaction inserted is its own until it commits
        return Checkpoint.from_mapping(created._mapping), True
    return checkpoint_for(conn, sink, batch_id, lock=True), False


_BEGIN_CHECKPOINT = (pg_insert(checkpoints).on_conflict_do_nothing(index_elements=["sink_id", "query_id", "batch_id"])
                     .returning(*checkpoints.c))
_DECIDED = select(checkpoints).where(checkpoints.c.state.in_([CheckpointState.COMMITTING.value,
                                                              CheckpointState.LOST.value])).order_by(checkpoints.c.id)
_DECIDED_OF_SINK = _DECIDED.where(checkpoints.c.sink_id == bindparam("sink_id"))


def decided_checkpoints(conn: Connection, sink_id: int | None = None) -> list[Checkpoint]:
    """COMMITTING and LOST checkpoints (every sink's, or one's): the decided commits."""
    rows = conn.execute(_DECIDED) if sink_id is None else conn.execute(_DECIDED_OF_SINK, dict(sink_id=sink_id))
    return [Checkpoint.from_mapping(r._mapping) for r in rows]


def attempt_of(conn: Connection, checkpoint: Checkpoint, number: int, *, lock: Lock = None) -> Attempt:
    stmt = select(attempts).where(attempts.c.checkpoint_id == checkpoint.id, attempts.c.number == number)
    if lock is not None:
        stmt = stmt.with_for_update(read=lock == "share")
    row = conn.execute(stmt).first()
    if row is None:
        raise e.NotFound("unknown_attempt", f"batch {checkpoint.batch_id} has no attempt {number}",
                         batch_id=checkpoint.batch_id, attempt=number)
    return Attempt.from_mapping(row._mapping)


def attempt_by_id(conn: Connection, attempt_id: int) -> Attempt:
    return Attempt.from_mapping(conn.execute(select(attempts).where(attempts.c.id == attempt_id)).one()._mapping)


def attempts_of(conn: Connection, checkpoint_ids: Sequence[int]) -> list[Attempt]:
    if not checkpoint_ids:
        return []
    rows = conn.execute(select(attempts).where(attempts.c.checkpoint_id.in_(list(checkpoint_ids)))
                        .order_by(attempts.c.checkpoint_id, attempts.c.number))
    return [Attempt.from_mapping(r._mapping) for r in rows]


def latest_attempt(conn: Connection, checkpoint: Checkpoint) -> Attempt | None:
    if checkpoint.current_attempt == 0:
        return None
    return attempt_of(conn, checkpoint, checkpoint.current_attempt)


_OPEN_ATTEMPTS = (select(attempts).where(attempts.c.sink_id == bindparam("sink_id"),
                                         attempts.c.state == AttemptState.OPEN.value)
                  .order_by(attempts.c.id).with_for_update())
_INSERT_ATTEMPT = insert(attempts).returning(*attempts.c)
_MAKE_CURRENT = (update(checkpoints).where(checkpoints.c.id == bindparam("checkpoint_id"))
                 .values(current_attempt=bindparam("number")).returning(*checkpoints.c))


def open_attempts(conn: Connection, sink_id: int) -> list[Attempt]:
    """The sink's OPEN attempts, locked FOR UPDATE (in id order)."""
    return [Attempt.from_mapping(r._mapping) for r in conn.execute(_OPEN_ATTEMPTS, dict(sink_id=sink_id))]


def insert_attempt(conn: Connection, checkpoint: Checkpoint, number: int, generation: int, partitions: int | None,
                   now: datetime) -> tuple[Checkpoint, Attempt]:
    """The batch's attempt `number`, made its current one: the checkpoint and the attempt."""
    row = conn.execute(_INSERT_ATTEMPT, dict(
        checkpoint_id=checkpoint.id, sink_id=checkpoint.sink_id, number=number, generation=generation,
        state=AttemptState.OPEN.value, partitions=partitions, started_at=now,
    )).one()
    current = conn.execute(_MAKE_CURRENT, dict(checkpoint_id=checkpoint.id, number=number)).one()
    return Checkpoint.from_mapping(current._mapping), Attempt.from_mapping(row._mapping)


def bind_digest(conn: Connection, checkpoint_id: int, digest: str) -> None:
    conn.execute(update(checkpoints).where(checkpoints.c.id == checkpoint_id, checkpoints.c.offsets_digest.is_(None))
                 .values(offsets_digest=digest))


_MOVE_CHECKPOINT = (update(checkpoints).where(checkpoints.c.id == bindparam("checkpoint_id"),
                                               checkpoints.c.state == bindparam("old_state"))
                    .returning(*checkpoints.c))
_MOVE_ATTEMPTS = (update(attempts).where(attempts.c.id.in_(bindparam("ids", expanding=True)),
                                         attempts.c.state == bindparam("old_state"))
                  .returning(*attempts.c))


def move_checkpoint(conn: Connection, checkpoint: Checkpoint, new: CheckpointState, **values: Any) -> Checkpoint:
    """Compare-and-set the checkpoint from its state as read to `new`; raises if it moved since."""
    require_transition(checkpoint.state, new)
    row = conn.execute(_MOVE_CHECKPOINT, dict(checkpoint_id=checkpoint.id, old_state=checkpoint.state.value,
                                              state=new.value, **values)).first()
    if row is None:
        raise AssertionError(f"checkpoint {checkpoint.id} left {checkpoint.state} under its lock")
    return Checkpoint.from_mapping(row._mapping)


def move_attempts(conn: Connection, ids: Iterable[int], old: StrEnum, new: AttemptState, **values: Any) -> list[Attempt]:
    """Compare-and-set: the attempts among `ids` still in `old` move to `new`; the moved ones, by id."""
    require_transition(old, new)
    ids = list(ids)
    if not ids:
        return []
    rows = conn.execute(_MOVE_ATTEMPTS, dict(ids=ids, old_state=old.value, state=new.value, **values))
    return sorted((Attempt.from_mapping(r._mapping) for r in rows), key=lambda a: a.id)


def committing_batches(conn: Connection, sink_id: int) -> list[int]:
    return list(conn.execute(select(checkpoints.c.batch_id).where(
        checkpoints.c.sink_id == sink_id, checkpoints.c.state == CheckpointState.COMMITTING.value)).scalars())


def lost_batches(conn: Connection, sink_id: int) -> list[int]:
    return list(conn.execute(select(checkpoints.c.batch_id).where(
        checkpoints.c.sink_id == sink_id, checkpoints.c.state == CheckpointState.LOST.value)
        .order_by(checkpoints.c.batch_id)).scalars())


def count_open_attempts(conn: Connection, sink_id: int) -> int:
    return int(conn.execute(select(func.count()).select_from(attempts).where(
        attempts.c.sink_id == sink_id, attempts.c.state == AttemptState.OPEN.value)).scalar_one())


def lock_attempt(conn: Connection, attempt_id: int) -> None:
    conn.execute(select(attempts.c.id).where(attempts.c.id == attempt_id).with_for_update())
