"""Checkpoints (one per batch of a sink's query) and their attempts: reads, inserts and the
compare-and-set moves of their states."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ..protocol import errors as e
from ..protocol.model import Attempt, Checkpoint, Sink
from ..protocol.states import AttemptState, CheckpointState, require_transition
from .sinks import Lock
from .tables import attempts, checkpoints


def checkpoint_for(conn: Connection, sink: Sink, batch_id: int, *, lock: bool = False) -> Checkpoint:
    """The batch of the sink's current lineage (404 if it was never begun)."""
    stmt = select(checkpoints).where(checkpoints.c.sink_id == sink.id, checkpoints.c.batch_id == batch_id,
                                     checkpoints.c.query_id == (sink.lineage_query_id or ""))
    row = conn.execute(stmt.with_for_update() if lock else stmt).first()
    if row is None:
        raise e.NotFound("unknown_checkpoint", f"batch {batch_id} of sink {sink.name!r} was never begun",
                         batch_id=batch_id)
    return Checkpoint.from_mapping(row._mapping)


def checkpoint_by_id(conn: Connection, checkpoint_id: int, *, lock: bool = False) -> Checkpoint:
    stmt = select(checkpoints).where(checkpoints.c.id == checkpoint_id)
    return Checkpoint.from_mapping(conn.execute(stmt.with_for_update() if lock else stmt).one()._mapping)


def checkpoint_begun(conn: Connection, sink: Sink, batch_id: int, now: datetime,
                     digest: str | None) -> tuple[Checkpoint, bool]:
    """The batch's checkpoint, created OPEN (bound to `digest`) if it is new, locked FOR UPDATE;
    and whether it was new."""
    assert sink.lineage_query_id is not None
    created = conn.execute(pg_insert(checkpoints).values(
        sink_id=sink.id, query_id=sink.lineage_query_id, batch_id=batch_id, state=CheckpointState.OPEN.value,
        created_at=now, offsets_digest=digest,
    ).on_conflict_do_nothing(index_elements=["sink_id", "query_id", "batch_id"]).returning(checkpoints.c.id)).first()
    return checkpoint_for(conn, sink, batch_id, lock=True), created is not None


def decided_checkpoints(conn: Connection, sink_id: int | None = None) -> list[Checkpoint]:
    """COMMITTING and LOST checkpoints (every sink's, or one's): the decided commits."""
    stmt = select(checkpoints).where(checkpoints.c.state.in_([CheckpointState.COMMITTING.value,
                                                              CheckpointState.LOST.value]))
    if sink_id is not None:
        stmt = stmt.where(checkpoints.c.sink_id == sink_id)
    return [Checkpoint.from_mapping(r._mapping) for r in conn.execute(stmt.order_by(checkpoints.c.id))]


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


def open_attempts(conn: Connection, sink_id: int) -> list[Attempt]:
    """The sink's OPEN attempts, locked FOR UPDATE (in id order)."""
    rows = conn.execute(select(attempts).where(attempts.c.sink_id == sink_id, attempts.c.state == AttemptState.OPEN.value)
                        .order_by(attempts.c.id).with_for_update())
    return [Attempt.from_mapping(r._mapping) for r in rows]


def insert_attempt(conn: Connection, checkpoint: Checkpoint, number: int, generation: int, partitions: int | None,
                   now: datetime) -> Attempt:
    row = conn.execute(insert(attempts).values(
        checkpoint_id=checkpoint.id, sink_id=checkpoint.sink_id, number=number, generation=generation,
        state=AttemptState.OPEN.value, partitions=partitions, started_at=now,
    ).returning(*attempts.c)).one()
    conn.execute(update(checkpoints).where(checkpoints.c.id == checkpoint.id).values(current_attempt=number))
    return Attempt.from_mapping(row._mapping)


def bind_digest(conn: Connection, checkpoint_id: int, digest: str) -> None:
    conn.execute(update(checkpoints).where(checkpoints.c.id == checkpoint_id, checkpoints.c.offsets_digest.is_(None))
                 .values(offsets_digest=digest))


def move_checkpoint(conn: Connection, checkpoint: Checkpoint, new: CheckpointState, **values: Any) -> Checkpoint:
    """Compare-and-set the checkpoint from its state as read to `new`; raises if it moved since."""
    require_transition(checkpoint.state, new)
    row = conn.execute(update(checkpoints).where(checkpoints.c.id == checkpoint.id,
                                                 checkpoints.c.state == checkpoint.state.value)
                       .values(state=new.value, **values).returning(*checkpoints.c)).first()
    if row is None:
        raise AssertionError(f"checkpoint {checkpoint.id} left {checkpoint.state} under its lock")
    return Checkpoint.from_mapping(row._mapping)


def move_attempts(conn: Connection, ids: Iterable[int], old: StrEnum, new: AttemptState, **values: Any) -> list[Attempt]:
    """Compare-and-set: the attempts among `ids` still in `old` move to `new`; the moved ones, by id."""
    require_transition(old, new)
    ids = list(ids)
    if not ids:
        return []
    rows = conn.execute(update(attempts).where(attempts.c.id.in_(ids), attempts.c.state == old.value)
                        .values(state=new.value, **values).returning(*attempts.c))
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
