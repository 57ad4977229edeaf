"""What the database itself guarantees about leases and the id pool, whatever the code above it
does (coordinator/store/tables.py): I3 as the unique index uq_leases_held (no id held by two
unresolved leases), resolved_at following the state (ck_leases_resolved), one pre-lease per
partition and one lease per try, a lease naming its attempt's checkpoint and sink; and the
store's own compare-and-set writes of leases and the pool (store/leases.py, store/pool.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import IntegrityError

from coordinator.protocol.model import Attempt, Checkpoint, Lease, PrecommitRecord, Sink
from coordinator.protocol.states import LeaseState
from coordinator.service import Coordinator, SinkSpec
from coordinator.service.clock import ManualClock
from coordinator.store import leases, pool

DEADLINE = timedelta(minutes=1)


def open_attempt(c: Coordinator, name: str = "s") -> tuple[Sink, Checkpoint, Attempt]:
    """A sink with batch 0 begun (no pre-leases): the rows a lease names."""
    c.register_sink(SinkSpec(name, f"{name}-eos", "kafka:9092", ["out"]), "test")
    gen, _ = c.start_generation(name, "q", "r", "test")
    begun = c.begin_checkpoint(name, 0, gen, "test")
    assert begun.attempt is not None
    return c.get_sink(name), begun.checkpoint, begun.attempt


def grant(conn: Connection, sink: Sink, attempt: Attempt, now: datetime, *, ordinal: int, partition: int = 0,
          task: int | None = 1) -> Lease:
    (x,) = leases.grant(conn, sink_id=sink.id, checkpoint_id=attempt.checkpoint_id, attempt_id=attempt.id,
                        new=[leases.NewLease(ordinal, f"{sink.transactional_id_prefix}-{ordinal}", partition, task)],
                        now=now, deadline_at=now + DEADLINE)
    return x


def refused(engine: Engine, constraint: str, write) -> None:  # type: ignore[no-untyped-def]
    """The write, in its own transaction, is refused by the named constraint (and rolled back)."""
    with pytest.raises(IntegrityError) as exc, engine.begin() as conn:
        write(conn)
    assert constraint in str(exc.value.orig), exc.value.orig


# --- I3 in the database: uq_leases_held ----------------------------------------------------------


def test_a_second_unresolved_lease_on_one_id_is_refused(coordinator: Coordinator, clock: ManualClock) -> None:
    sink, _, attempt = open_attempt(coordinator)
    now = clock.now()
    with coordinator.engine.begin() as conn:
        first = grant(conn, sink, attempt, now, ordinal=3, task=None)  # a pre-lease holds its id too
    for task in (None, 7):  # another pre-lease, or a try's lease, on the same id (other partitions)
        refused(coordinator.engine, "uq_leases_held",
                lambda conn: grant(conn, sink, attempt, now, ordinal=3, partition=1 + (task or 0), task=task))
    # each unresolved state holds the id: claimed, decided, aborting
    for old, new in ((LeaseState.PRELEASED, LeaseState.LEASED), (LeaseState.LEASED, LeaseState.ABORTING)):
        with coordinator.engine.begin() as conn:
            assert leases.move(conn, [first.id], [old], new, now, **({"task_attempt_id": 5} if new is LeaseState.LEASED
                                                                      else {}))
        refused(coordinator.engine, "uq_leases_held", lambda conn: grant(conn, sink, attempt, now, ordinal=3, partition=9))
    # resolved: the id may be held again (the quarantine is the pool's business, not the index's)
    with coordinator.engine.begin() as conn:
        (done,) = leases.move(conn, [first.id], [LeaseState.ABORTING], LeaseState.ABORTED, now)
        assert done.resolved_at == now
        again = grant(conn, sink, attempt, now, ordinal=3, partition=9)
    assert again.ordinal == 3 and again.state is LeaseState.LEASED


def test_the_same_ordinal_of_another_sink_is_another_id(coordinator: Coordinator, clock: ManualClock) -> None:
    a_sink, _, a_attempt = open_attempt(coordinator, "a")
    b_sink, _, b_attempt = open_attempt(coordinator, "b")
    with coordinator.engine.begin() as conn:
        grant(conn, a_sink, a_attempt, clock.now(), ordinal=0)
        grant(conn, b_sink, b_attempt, clock.now(), ordinal=0)
    assert sorted((x.sink_id, x.ordinal) for x in coordinator.snapshot().leases) == [(a_sink.id, 0), (b_sink.id, 0)]


# --- resolved_at follows the state: ck_leases_resolved -------------------------------------------


@pytest.mark.parametrize("state", ["PRELEASED", "LEASED", "COMMITTING", "ABORTING", "LOST_ABORTING"])
def test_an_unresolved_state_with_resolved_at_is_refused(coordinator: Coordinator, clock: ManualClock,
                                                         state: str) -> None:
    sink, _, attempt = open_attempt(coordinator)
    with coordinator.engine.begin() as conn:
        x = grant(conn, sink, attempt, clock.now(), ordinal=0)
    refused(coordinator.engine, "ck_leases_resolved", lambda conn: conn.execute(
        text("UPDATE leases SET state = :s, resolved_at = now() WHERE id = :id"), {"s": state, "id": x.id}))


@pytest.mark.parametrize("state", ["COMMITTED", "ABORTED", "LOST"])
def test_an_end_state_without_resolved_at_is_refused(coordinator: Coordinator, clock: ManualClock, state: str) -> None:
    sink, _, attempt = open_attempt(coordinator)
    with coordinator.engine.begin() as conn:
        x = grant(conn, sink, attempt, clock.now(), ordinal=0)
    refused(coordinator.engine, "ck_leases_resolved", lambda conn: conn.execute(
        text("UPDATE leases SET state = :s WHERE id = :id"), {"s": state, "id": x.id}))
    with coordinator.engine.begin() as conn:  # with it, the same state is accepted
        conn.execute(text("UPDATE leases SET state = :s, resolved_at = now() WHERE id = :id"), {"s": state, "id": x.id})


def test_a_state_outside_the_machine_is_refused(coordinator: Coordinator, clock: ManualClock) -> None:
    sink, _, attempt = open_attempt(coordinator)
    with coordinator.engine.begin() as conn:
        x = grant(conn, sink, attempt, clock.now(), ordinal=0)
    refused(coordinator.engine, "ck_leases_state", lambda conn: conn.execute(
        text("UPDATE leases SET state = 'PRECOMMITTED', resolved_at = now() WHERE id = :id"), {"id": x.id}))


# --- one pre-lease per partition, one lease per try --------------------------------------------


def test_one_pre_lease_per_partition_and_one_lease_per_try(coordinator: Coordinator, clock: ManualClock) -> None:
    sink, _, attempt = open_attempt(coordinator)
    now = clock.now()
    with coordinator.engine.begin() as conn:
        grant(conn, sink, attempt, now, ordinal=0, partition=0, task=None)
        grant(conn, sink, attempt, now, ordinal=1, partition=0, task=7)
        grant(conn, sink, attempt, now, ordinal=2, partition=1, task=7)  # the same try id, another partition
    unique = "uq_leases_attempt_id_partition_task_attempt_id"
    refused(coordinator.engine, unique, lambda conn: grant(conn, sink, attempt, now, ordinal=5, partition=0, task=None))
    refused(coordinator.engine, unique, lambda conn: grant(conn, sink, attempt, now, ordinal=5, partition=0, task=7))


def test_a_lease_names_its_attempts_checkpoint_and_sink(coordinator: Coordinator, clock: ManualClock) -> None:
    """One composite foreign key: a lease's checkpoint and sink are its attempt's."""
    sink, _, attempt = open_attempt(coordinator)
    other, other_cp, _ = open_attempt(coordinator, "other")
    now = clock.now()

    def insert(sink_id: int, checkpoint_id: int, attempt_id: int):  # type: ignore[no-untyped-def]
        return lambda conn: leases.grant(conn, sink_id=sink_id, checkpoint_id=checkpoint_id, attempt_id=attempt_id,
                                         new=[leases.NewLease(0, "x-0", 0, 1)], now=now, deadline_at=now + DEADLINE)

    fk = "fk_leases_attempt_id_attempts"
    refused(coordinator.engine, fk, insert(sink.id, other_cp.id, attempt.id))  # another checkpoint
    refused(coordinator.engine, fk, insert(other.id, attempt.checkpoint_id, attempt.id))  # another sink
    refused(coordinator.engine, fk, insert(sink.id, attempt.checkpoint_id, attempt.id + 1_000))  # no such attempt
    with coordinator.engine.begin() as conn:
        insert(sink.id, attempt.checkpoint_id, attempt.id)(conn)


# --- the store's compare-and-set writes -----------------------------------------------------------


def test_a_pre_lease_is_claimed_once(coordinator: Coordinator, clock: ManualClock) -> None:
    sink, _, attempt = open_attempt(coordinator)
    with coordinator.engine.begin() as conn:
        pre = grant(conn, sink, attempt, clock.now(), ordinal=0, task=None)
    assert pre.state is LeaseState.PRELEASED and pre.task_attempt_id is None and not pre.claimed
    later = clock.advance(ms=250)
    with coordinator.engine.begin() as conn:
        claimed = leases.claim(conn, pre, 41, later, later + DEADLINE)
        second = leases.claim(conn, pre, 42, later, later + DEADLINE)  # a try that read it PRELEASED too
    assert claimed is not None and claimed.task_attempt_id == 41 and claimed.state is LeaseState.LEASED
    assert (claimed.taken_at, claimed.leased_at, claimed.deadline_at) == (pre.taken_at, later, later + DEADLINE)
    assert second is None


def test_moves_change_only_leases_still_in_the_old_states(coordinator: Coordinator, clock: ManualClock) -> None:
    sink, _, attempt = open_attempt(coordinator)
    now = clock.now()
    with coordinator.engine.begin() as conn:
        a = grant(conn, sink, attempt, now, ordinal=0, partition=0, task=1)
        b = grant(conn, sink, attempt, now, ordinal=1, partition=1, task=2)
        assert [x.id for x in leases.move(conn, [a.id], [LeaseState.LEASED], LeaseState.ABORTING, now)] == [a.id]
        # a second finisher's move from LEASED finds a no longer LEASED: nothing moves
        assert leases.move(conn, [a.id, b.id], [LeaseState.LEASED], LeaseState.ABORTING, now)[0].id == b.id
        assert leases.move(conn, [a.id], [LeaseState.LEASED], LeaseState.ABORTING, now) == []
        record = PrecommitRecord(2, 900, 1, 5, 50, 3, [["out", 0, 17]])
        # a winner is decided only while LEASED
        assert leases.decide_winners(conn, [(b, record)]) == []


def test_the_decision_stores_each_winners_record(coordinator: Coordinator, clock: ManualClock) -> None:
    sink, _, attempt = open_attempt(coordinator)
    now = clock.now()
    with coordinator.engine.begin() as conn:
        xs = [grant(conn, sink, attempt, now, ordinal=p, partition=p, task=10 + p) for p in range(3)]
        records = [PrecommitRecord(10 + p, 900 + p, p, 5 + p, 50 + p, None if p else 3,
                                   [["out", p, 40 + p]] if p != 1 else None) for p in range(3)]
        won = leases.decide_winners(conn, list(zip(xs, records)))
    assert [x.state for x in won] == [LeaseState.COMMITTING] * 3 and [x.resolved_at for x in won] == [None] * 3
    assert [(x.producer_id, x.producer_epoch, x.records, x.bytes, x.write_ms, x.first_offsets) for x in won] == [
        (900, 0, 5, 50, 3, '[["out", 0, 40]]'), (901, 1, 6, 51, None, None), (902, 2, 7, 52, None, '[["out", 2, 42]]')]


def test_busy_ids_are_the_held_and_the_quarantined(coordinator: Coordinator, clock: ManualClock) -> None:
    sink, _, attempt = open_attempt(coordinator)
    now = clock.now()
    with coordinator.engine.begin() as conn:
        grant(conn, sink, attempt, now, ordinal=0, task=None)
        done = grant(conn, sink, attempt, now, ordinal=1, partition=1)
        leases.move(conn, [done.id], [LeaseState.LEASED], LeaseState.ABORTING, now)
        leases.move(conn, [done.id], [LeaseState.ABORTING], LeaseState.ABORTED, now)
        pool.quarantine(conn, sink.id, [1, 4], now + timedelta(seconds=10))
        pool.quarantine(conn, sink.id, [4], now + timedelta(seconds=5))  # an earlier end does not shorten it
        pool.quarantine(conn, sink.id, [], now)
        assert pool.busy(conn, sink.id, now) == {0, 1, 4}
        assert pool.busy(conn, sink.id, now + timedelta(seconds=10)) == {0}  # until is exclusive
        assert {(q.ordinal, q.until) for q in pool.quarantines(conn)} == {(1, now + timedelta(seconds=10)),
                                                                          (4, now + timedelta(seconds=10))}
        assert pool.read(conn, sink.id).size == 0  # a grant moves the pool; these writes did not
