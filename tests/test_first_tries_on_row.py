"""A batch's first tries on its attempt row (migration 0012): the common path writes no lease row,
the views show the same leases a lease row would hold, and anything else moves them into
lease_rows first, unchanged and with the same ids. Real Postgres per test; Kafka is the
record-only control plane (these tests are about the bookkeeping)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import Lease, PartitionResult, PrecommitRecord
from coordinator.protocol.rules import PrecommitRequest
from coordinator.protocol.states import LeaseState
from coordinator.service import Coordinator, SinkSpec
from coordinator.store.tables import attempt_of_first_try_id, first_try_lease_id

NAME, ACTOR = "orders", "test"


def start(c: Coordinator) -> int:
    c.register_sink(SinkSpec(NAME, "orders-eos", "kafka:9092", ["out"]), ACTOR)
    gen, _ = c.start_generation(NAME, "q1", "r1", ACTOR)
    return gen


def record(partition: int) -> PrecommitRecord:
    # partition 1's offsets name a topic that is not ASCII (not a Kafka name): its stored text is
    # the text the coordinator sent (UTF-8, compact), which json.dumps would write otherwise
    extra = [["tōpic", 0, 5]] if partition == 1 else []
    return PrecommitRecord(3000 + partition, 1, 10 + partition, 100, 4, [["out", partition, 70], *extra])


def rows(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params).all())


def leases_of(c: Coordinator, attempt_id: int) -> list[Lease]:
    return [x for x in c.snapshot().leases if x.attempt_id == attempt_id]


def test_the_common_path_writes_no_lease_row_and_the_views_show_every_lease(coordinator: Coordinator,
                                                                            engine: Engine) -> None:
    gen = start(coordinator)
    begun = coordinator.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=3)
    assert begun.attempt is not None
    assert [x.id for x in begun.pre_leases] == [first_try_lease_id(begun.attempt.id, p) for p in range(3)]
    assert leases_of(coordinator, begun.attempt.id) == begun.pre_leases  # the view: as begin answered
    results = [PartitionResult(p, begun.pre_leases[p].id, record(p)) for p in (0, 1)] + [PartitionResult(2, None)]
    answer = coordinator.commit(NAME, 1, begun.attempt.number, gen, results, ACTOR)
    assert answer.checkpoint.state == "COMMITTED"
    assert rows(engine, "SELECT count(*) FROM lease_rows") == [(0,)]
    after = leases_of(coordinator, begun.attempt.id)
    assert [x.state for x in after] == [LeaseState.COMMITTED, LeaseState.COMMITTED, LeaseState.ABORTED]
    assert [(x.producer_id, x.producer_epoch, x.records, x.bytes, x.write_ms) for x in after[:2]] == [
        (3000, 1, 10, 100, 4), (3001, 1, 11, 100, 4)]
    assert after[0].first_offsets == '[["out",0,70]]' and after[2].producer_id is None
    assert after[1].first_offsets == '[["out",1,70],["tōpic",0,5]]'  # as sent: json keeps the text (0015)
    assert all(x.resolved_at is not None for x in after)
    assert sorted(answer.winners, key=lambda w: w.id) == after[:2]  # the winners answered: as stored
    assert [str(v) for v in check_invariants(coordinator.snapshot(), settled=True)] == []
    assert rows(engine, "SELECT count(*) FROM transactional_ids WHERE state <> 'FREE'") == [(0,)]


def test_records_without_a_write_time_or_first_offsets_are_answered_as_stored(coordinator: Coordinator) -> None:
    """An older writer's record has neither (both null in the attempt row's document); the winners
    the decision builds from its own encoding must still be the rows the views read back."""
    gen = start(coordinator)
    begun = coordinator.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=3)
    assert begun.attempt is not None
    bare = [PrecommitRecord(4000 + p, 2, 5, 50) for p in range(3)]
    bare[1] = PrecommitRecord(4001, 2, 5, 50, 9, [])  # an empty list is kept, not read as null
    answer = coordinator.commit(NAME, 1, begun.attempt.number, gen,
                                [PartitionResult(p, begun.pre_leases[p].id, bare[p]) for p in range(3)], ACTOR)
    after = leases_of(coordinator, begun.attempt.id)
    assert [(x.write_ms, x.first_offsets) for x in after] == [(None, None), (9, "[]"), (None, None)]
    assert sorted(answer.winners, key=lambda w: w.id) == after


def test_a_retrys_lease_moves_the_first_tries_to_lease_rows_unchanged(coordinator: Coordinator,
                                                                       engine: Engine) -> None:
    gen = start(coordinator)
    begun = coordinator.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2)
    assert begun.attempt is not None
    before = leases_of(coordinator, begun.attempt.id)
    retry = coordinator.begin_partition(NAME, 1, begun.attempt.number, gen, 0, 5)
    assert rows(engine, "SELECT first_tids, first_deadline_at FROM attempts WHERE id = :a", a=begun.attempt.id) == [
        (None, None)]
    assert sorted(r[0] for r in rows(engine, "SELECT id FROM lease_rows")) == sorted([*(x.id for x in before), retry.id])
    assert leases_of(coordinator, begun.attempt.id) == sorted([*before, retry], key=lambda x: x.id)
    # the retry wins partition 0: the first try there loses, and its transaction is aborted
    results = [PartitionResult(0, retry.id, record(0)), PartitionResult(1, before[1].id, record(1))]
    answer = coordinator.commit(NAME, 1, begun.attempt.number, gen, results, ACTOR)
    assert answer.checkpoint.state == "COMMITTED"
    states = {x.id: x.state for x in leases_of(coordinator, begun.attempt.id)}
    assert states == {before[0].id: LeaseState.ABORTED, before[1].id: LeaseState.COMMITTED,
                      retry.id: LeaseState.COMMITTED}
    assert [str(v) for v in check_invariants(coordinator.snapshot(), settled=True)] == []


def test_a_first_try_found_by_its_id_and_pre_committed_over_http(coordinator: Coordinator, engine: Engine) -> None:
    """An older client pre-commits each lease by id: the id names its attempt, and the
    pre-commit (a change to one first try) moves the attempt's first tries to lease rows."""
    gen = start(coordinator)
    begun = coordinator.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2)
    assert begun.attempt is not None
    first = begun.pre_leases[1]
    assert attempt_of_first_try_id(first.id) == begun.attempt.id and attempt_of_first_try_id(7) is None
    done = coordinator.precommit(NAME, first.id, gen, PrecommitRequest(4242, 0, 3, 30))
    assert (done.id, done.state, done.producer_id) == (first.id, LeaseState.PRECOMMITTED, 4242)
    assert rows(engine, "SELECT id, state FROM lease_rows ORDER BY id") == [
        (begun.pre_leases[0].id, "LEASED"), (first.id, "PRECOMMITTED")]
    assert coordinator.precommit(NAME, first.id, gen, PrecommitRequest(4242, 0, 3, 30)) == done  # a retry


def test_an_aborted_attempt_keeps_its_first_tries_only_as_lease_rows(coordinator: Coordinator, engine: Engine) -> None:
    gen = start(coordinator)
    begun = coordinator.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2)
    assert begun.attempt is not None
    _, outcome = coordinator.abort_attempt(NAME, 1, begun.attempt.number, gen, "driver gave up", ACTOR)
    assert sorted(outcome.aborted) == sorted(x.transactional_id for x in begun.pre_leases)
    assert rows(engine, "SELECT state, first_tids FROM attempts") == [("ABORTED", None)]
    assert rows(engine, "SELECT state FROM lease_rows") == [("ABORTED",), ("ABORTED",)]
    # and the database refuses an attempt that ends otherwise with its first tries still on its row
    other = coordinator.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=1)
    assert other.attempt is not None
    with pytest.raises(IntegrityError, match="ck_attempts_first_tries"), engine.begin() as conn:
        conn.execute(text("UPDATE attempts SET state = 'ABORTED' WHERE id = :a"), {"a": other.attempt.id})


def test_a_commit_that_waited_for_the_attempt_sees_the_first_tries_another_transaction_moved(
    engine: Engine, kafka: Any
) -> None:
    """The commit's first statement (the first tries' decision, as commit_head after it) reads the
    first tries from the attempt's row it locked. A lease granted while the commit waits for that
    lock (here: the first tries moved to lease_rows and a retry's lease added, as begin_partition
    does) is seen after the wait: the locked row is its latest version, with no first tries left
    on it, so the decision's guard does not hold and the general path reads the lease rows.
    Reading the row as the statement's snapshot had it would decide the first tries alone and
    miss the retry's transaction."""
    import threading
    import time

    from coordinator.service.clock import DatabaseClock
    from coordinator.store import repo

    c = Coordinator(engine, kafka, clock=DatabaseClock(engine))
    try:
        gen = start(c)
        begun = c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2)
        assert begun.attempt is not None
        attempt_id = begun.attempt.id
        results = [PartitionResult(x.partition, x.id, record(x.partition)) for x in begun.pre_leases]
        outcome: dict[str, Any] = {}

        def commit() -> None:
            try:
                outcome["answer"] = c.commit(NAME, 1, begun.attempt.number, gen, results, ACTOR)
            except Exception as exc:  # noqa: BLE001 - reported below
                outcome["error"] = exc

        committer = threading.Thread(target=commit)
        with engine.begin() as conn:  # holds the attempt's lock until the block ends
            repo.materialize_first_tries(conn, [attempt_id])
            retry_id = conn.execute(text(
                "INSERT INTO lease_rows (sink_id, checkpoint_id, attempt_id, partition, task_attempt_id, "
                "transactional_id, state, leased_at, deadline_at) "
                "SELECT sink_id, checkpoint_id, attempt_id, 1, 9, 'orders-eos-retry', 'LEASED', now(), "
                "now() + interval '1 minute' FROM lease_rows WHERE attempt_id = :a AND partition = 1 RETURNING id"
            ), {"a": attempt_id}).scalar_one()
            committer.start()
            deadline = time.monotonic() + 20
            while not rows(engine, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"):
                assert time.monotonic() < deadline, "the commit never waited for the attempt's lock"
                time.sleep(0.02)
        committer.join(timeout=30)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["answer"].checkpoint.state == "COMMITTED"
        states = {x.id: x.state for x in leases_of(c, attempt_id)}
        assert states.pop(retry_id) is LeaseState.ABORTED  # the loser's transaction was ended
        assert sorted(states) == [x.id for x in begun.pre_leases]
        assert set(states.values()) == {LeaseState.COMMITTED}
        assert rows(engine, "SELECT count(*) FROM lease_rows WHERE attempt_id = :a", a=attempt_id) == [(3,)]
    finally:
        c.close()
