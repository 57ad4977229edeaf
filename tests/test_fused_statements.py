"""Statements of the hot path that do several steps at once (coordinator/store/hot_path.py).

- Begin's first statement (`begin_head`): for a new batch it creates the checkpoint and reads what
  the rest of begin needs in one round trip; for an existing checkpoint it locks the row and reads
  the rest in a statement of its own, whose snapshot is taken after the lock (so a retried or
  resumed begin sees its attempt and leases).
- The committed mark after Kafka (`mark_committed`): the winners, and the checkpoint when none of
  its winners is left COMMITTING, in one statement whose guard must agree with the service's rule.
- The common case's own statements (`begin_new_batch`, `decide_first_tries`,
  `mark_first_tries_committed`): a new batch's whole begin, a commit's locks and decision, and the
  deciding call's mark of its first tries, each guarded so that it writes nothing outside that
  case and the general path runs instead.

Real Postgres, the database's clock."""

from __future__ import annotations

import re
from typing import Any, Iterator

import pytest
from psycopg import pq
from sqlalchemy import Engine, event, select
from sqlalchemy.exc import DBAPIError

from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.model import PartitionResult, PrecommitRecord
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import CheckpointState, LeaseState
from coordinator.service import Coordinator, SinkSpec
from coordinator.service.clock import DatabaseClock
from coordinator.store import driver_sql, hot_path
from coordinator.store.driver_sql import DriverStatement
from coordinator.store.tables import checkpoints, lease_rows, transactional_ids

NAME = "orders"


@pytest.fixture
def kafka() -> RecordingControlPlane:
    return RecordingControlPlane()


@pytest.fixture
def db_clock_coordinator(engine: Engine, kafka: RecordingControlPlane) -> Iterator[Coordinator]:
    c = Coordinator(engine, kafka, clock=DatabaseClock(engine))
    c.register_sink(SinkSpec(NAME, "orders-eos", "kafka:9092", ["out"]), "test")
    yield c
    c.close()


def _source(statement: DriverStatement) -> str:
    """A driver statement's SQL as written (its `:name` parameters)."""
    return re.sub(r"%\((\w+)\)s", r":\1", statement.sql)


# the committed mark's two guards: no winner of the attempt left COMMITTING among its lease rows,
# nor among its first tries on its row (r: each first try, whether it won, whether `done` names it)
_LEASE_ROWS_GUARD = (r"AND NOT EXISTS \(SELECT 1 FROM lease_rows WHERE attempt_id = :attempt_id AND state = "
                     r"'COMMITTING'\s+AND id <> ALL\(CAST\(:done AS bigint\[\]\)\)\)")
_FIRST_TRIES_GUARD = r"AND NOT EXISTS \(SELECT 1 FROM r WHERE r.won AND NOT r.named\)"


def _without(statement: DriverStatement, guard: str) -> DriverStatement:
    """A broken variant of a statement: without that guard (a pattern found once), planned alike."""
    source = _source(statement)
    found = re.findall(guard, source)
    assert len(found) == 1, found
    return DriverStatement(source.replace(found[0], ""), generic_plan=statement.generic_plan)


def _statements(engine: Engine) -> list[str]:
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append(" ".join(statement.split())[:60])

    event.listen(engine, "before_cursor_execute", before)
    return seen


def test_a_new_batch_is_created_and_read_in_one_statement_an_existing_one_in_two(
    db_clock_coordinator: Coordinator, engine: Engine
) -> None:
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    open_one = c.begin_checkpoint(NAME, 1, gen, "test", partitions=2)  # left open: batch 2's begin supersedes it

    seen = _statements(engine)
    with engine.begin() as conn:
        new = hot_path.begin_head(conn, NAME, 2, None, "digest-2")
    assert len(seen) == 1, seen
    assert new is not None and new.head is not None
    assert new.head.checkpoint.batch_id == 2 and new.head.checkpoint.offsets_digest == "digest-2"
    assert new.head.latest is None and new.head.ended_leases == []
    assert new.head.open_attempt_ids == [open_one.attempt.id]  # read in the same statement
    assert new.head.checkpoint.created_at == new.db_now  # the statement's own clock

    seen.clear()
    with engine.begin() as conn:
        again = hot_path.begin_head(conn, NAME, 1, None, None)
    assert len(seen) == 2, seen  # ON CONFLICT took the lock; the reads come after it
    assert again is not None and again.head is not None
    assert again.head.latest is not None and again.head.latest.id == open_one.attempt.id
    assert again.head.open_attempt_ids == [open_one.attempt.id]


def _commit_batch(c: Coordinator, gen: int, batch_id: int, partitions: int) -> None:
    begun = c.begin_checkpoint(NAME, batch_id, gen, "test", partitions=partitions)
    results = [PartitionResult(x.partition, x.id, PrecommitRecord(100 + x.partition, 0, 1, 10)) for x in begun.pre_leases]
    assert c.commit(NAME, batch_id, begun.attempt.number, gen, results, "test").checkpoint.state is CheckpointState.COMMITTED


def test_a_new_batchs_begin_is_one_statement_and_anything_else_the_two_statement_path(
    db_clock_coordinator: Coordinator, engine: Engine
) -> None:
    """A new batch's begin is one round trip: one statement, sent with its BEGIN and COMMIT, that
    leases the pool's least recently released FREE ids to partitions 0, 1, ... in that order. When
    the pool must grow, or an attempt of the sink is still OPEN, that statement writes nothing and
    begin takes its two-statement path: its first statement with the pool's query, which locks ids
    only for a checkpoint without an attempt yet (sent with a retried begin's, it locks none)."""
    from bench.measure import SqlCounter

    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    _commit_batch(c, gen, 1, partitions=3)  # the pool now has 3 FREE ids
    with engine.begin() as conn:  # committed: a rollback would cost the next send a check of what is prepared
        free = [tid for (tid,) in conn.execute(select(transactional_ids.c.transactional_id).order_by(
            transactional_ids.c.released_at, transactional_ids.c.ordinal))]
    counter = SqlCounter(engine)
    try:
        begun = c.begin_checkpoint(NAME, 2, gen, "test", partitions=2)
        assert counter.round_trips() == 1 and counter.statements == 1, vars(counter)
    finally:
        counter.close()
    assert [x.transactional_id for x in sorted(begun.pre_leases, key=lambda x: x.partition)] == free[:2]
    assert begun.checkpoint.current_attempt == begun.attempt.number == 1
    assert begun.checkpoint.created_at == begun.attempt.started_at
    assert c.checkpoint_detail(NAME, 2).leases == begun.pre_leases  # as the views read them back

    with engine.begin() as conn:  # batch 2 again: it has an attempt, so the FREE id left is not locked
        again = hot_path.begin_head(conn, NAME, 2, None, None, ids=2)
        assert again is not None and again.locked_ids == []
    with engine.begin() as conn:  # a new batch: it is
        new = hot_path.begin_head(conn, NAME, 3, None, None, ids=2)
        assert new is not None and [t for _, t in new.locked_ids] == free[2:]
        conn.rollback()

    # batch 3 needs the pool to grow, while batch 2's attempt is still OPEN (superseded by it)
    counter = SqlCounter(engine)
    try:
        grown = c.begin_checkpoint(NAME, 3, gen, "test", partitions=4)
        assert counter.statements > 3, vars(counter)
    finally:
        counter.close()
    assert grown.action is BeginAction.NEW_ATTEMPT and len(grown.pre_leases) == 4
    assert free[2] in {x.transactional_id for x in grown.pre_leases}
    assert sorted(grown.older_aborted + grown.older_abort_pending) == []  # batch 2's are not batch 3's
    assert c.checkpoint_detail(NAME, 2).attempts[0].state == "ABORTED"
    with engine.connect() as conn:
        assert conn.execute(select(checkpoints.c.batch_id).order_by(checkpoints.c.batch_id)).scalars().all() == [1, 2, 3]


_OPEN_ATTEMPT_GUARD = ("AND NOT EXISTS (SELECT 1 FROM attempts AS o WHERE o.sink_id = s.id AND o.state = 'OPEN' "
                       "AND o.finished_at IS NULL)")
_GENERATION_GUARD = "AND s.generation = :generation"


@pytest.mark.parametrize("broken", [None, _OPEN_ATTEMPT_GUARD, _GENERATION_GUARD],
                         ids=["as-built", "without-the-open-attempt-guard", "without-the-generation-guard"])
def test_the_one_statement_begin_leaves_a_superseded_attempt_and_a_stale_generation_to_the_rules(
    db_clock_coordinator: Coordinator, engine: Engine, monkeypatch: pytest.MonkeyPatch, broken: str | None
) -> None:
    """With FREE ids for every partition, a new batch's begin still takes the two-statement path
    when another batch's attempt is OPEN (it must be aborted first) or the driver's generation is
    stale (refused, nothing written). Broken variants without either guard leave the superseded
    attempt OPEN, or create a checkpoint for a fenced driver."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    _commit_batch(c, gen, 1, partitions=8)  # 8 FREE ids: no begin below grows the pool (aborted ids sit out a quarantine)
    if broken is not None:
        monkeypatch.setattr(hot_path, "_BEGIN_NEW_BATCH", _without(hot_path._BEGIN_NEW_BATCH, re.escape(broken)))
    left_open = c.begin_checkpoint(NAME, 2, gen, "test", partitions=2)
    c.begin_checkpoint(NAME, 3, gen, "test", partitions=2)
    superseded = c.checkpoint_detail(NAME, 2).attempts[0]
    newer, _ = c.start_generation(NAME, "q1", "r2", "test")  # fences gen (and aborts batch 3's attempt)
    try:
        c.begin_checkpoint(NAME, 4, gen, "test", partitions=2)
        refused = False
    except e.Conflict as refusal:
        refused = refusal.reason == e.STALE_GENERATION
    with engine.connect() as conn:
        batches = conn.execute(select(checkpoints.c.batch_id).order_by(checkpoints.c.batch_id)).scalars().all()
    as_built = (superseded.state == "ABORTED", refused, batches)
    assert left_open.attempt.id == superseded.id
    if broken is None:
        assert as_built == (True, True, [1, 2, 3])
    elif broken == _OPEN_ATTEMPT_GUARD:
        assert as_built[0] is False
    else:
        assert as_built[2] == [1, 2, 3, 4]


_DEADLINE_GUARD = r"AND \(hn.first_deadline_at >= .*?\n\s+OR cardinality\(CAST\(:unused AS int\[\]\)\) = :first_tries\)"
_ATTEMPT_ID_GUARD = r"AND hn.a_id = :attempt_id "
_FIRST_TRIES_COUNT_GUARD = r"AND cardinality\(hn.first_tids\) = :first_tries"
_SINK_GENERATION_GUARD = r"AND hn.s_generation = :generation"


@pytest.mark.parametrize("broken", [None, _DEADLINE_GUARD, _ATTEMPT_ID_GUARD, _FIRST_TRIES_COUNT_GUARD,
                                    _SINK_GENERATION_GUARD],
                         ids=["as-built", "without-the-deadline-guard", "without-the-attempt-guard",
                              "without-the-first-tries-count-guard", "without-the-sink-generation-guard"])
def test_the_one_statement_decision_leaves_every_other_commit_to_the_rules(
    db_clock_coordinator: Coordinator, engine: Engine, monkeypatch: pytest.MonkeyPatch, broken: str | None
) -> None:
    """A commit of first tries by partition is decided by one statement with its locks, when its
    guard holds; otherwise it writes nothing and the general path judges the commit: a deadline
    inside the margin (refused), lease ids of another batch's attempt (refused), fewer partitions
    than first tries (committed, the missing partition's try aborted), a fenced generation
    (refused). A broken variant without one of those guards decides such a commit; the service's
    check of the rules against the locked head then raises, and the scenario shows it."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    if broken is not None:
        monkeypatch.setattr(hot_path, "_DECIDE_FIRST_TRIES", _without(hot_path._DECIDE_FIRST_TRIES, broken))

    def record(x: Any) -> PrecommitRecord:
        return PrecommitRecord(100 + x.partition, 0, 1, 10)

    def outcome(batch_id: int, number: int, results: list[PartitionResult]) -> str:
        try:
            return str(c.commit(NAME, batch_id, number, gen, results, "test").checkpoint.state)
        except e.Conflict as refusal:
            return f"refused: {refusal.reason}"
        except AssertionError as tripped:
            assert "rules" in str(tripped), tripped
            return "decided against the rules"

    outcomes = {}
    # fewer partitions than first tries: partition 2's try is a loser, aborted; the rest commit
    begun = c.begin_checkpoint(NAME, 1, gen, "test", partitions=3)
    outcomes["fewer partitions"] = outcome(1, begun.attempt.number, [
        PartitionResult(x.partition, x.id, record(x)) for x in begun.pre_leases[:2]])
    # lease ids of batch 2's attempt (superseded by batch 3's begin) named for batch 3
    stale = c.begin_checkpoint(NAME, 2, gen, "test", partitions=2)
    begun = c.begin_checkpoint(NAME, 3, gen, "test", partitions=2)
    outcomes["another attempt's leases"] = outcome(3, begun.attempt.number, [
        PartitionResult(x.partition, x.id, record(x)) for x in stale.pre_leases])
    # the first tries' deadline inside the sink's margin
    begun = c.begin_checkpoint(NAME, 4, gen, "test", partitions=2)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE sinks SET commit_margin_ms = transaction_timeout_ms + 60000")
    outcomes["deadline"] = outcome(4, begun.attempt.number, [
        PartitionResult(x.partition, x.id, record(x)) for x in begun.pre_leases])
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE sinks SET commit_margin_ms = 5000")
    # the sink's generation moved on (as a newer driver's start does, before it aborts this attempt)
    begun = c.begin_checkpoint(NAME, 5, gen, "test", partitions=2)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE sinks SET generation = generation + 1")
    outcomes["fenced"] = outcome(5, begun.attempt.number, [
        PartitionResult(x.partition, x.id, record(x)) for x in begun.pre_leases])

    as_built = {"fewer partitions": "COMMITTED", "another attempt's leases": f"refused: {e.STALE_LEASE}",
                "deadline": f"refused: {e.DEADLINE_TOO_CLOSE}", "fenced": f"refused: {e.STALE_GENERATION}"}
    caught_by = {_DEADLINE_GUARD: "deadline", _ATTEMPT_ID_GUARD: "another attempt's leases",
                 _FIRST_TRIES_COUNT_GUARD: "fewer partitions", _SINK_GENERATION_GUARD: "fenced"}
    if broken is None:
        assert outcomes == as_built
        assert c.checkpoint_detail(NAME, 1).attempts[0].state == "COMMITTED"
    else:
        assert outcomes[caught_by[broken]] == "decided against the rules", outcomes


@pytest.mark.parametrize("order", ["by partition", "reversed"])
def test_the_decision_of_first_tries_records_its_winners_by_partition_in_its_event(
    db_clock_coordinator: Coordinator, engine: Engine, order: str
) -> None:
    """Its event's detail is `decision_event_detail`'s, as for lease rows: the winners by
    partition, the empty partition left out; by partition the decision is the commit's one
    statement, reversed the general path's last."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    begun = c.begin_checkpoint(NAME, 1, gen, "test", partitions=3)
    results = [PartitionResult(x.partition, None) if x.partition == 1 else
               PartitionResult(x.partition, x.id, PrecommitRecord(100 + x.partition, 0, 1, 10)) for x in begun.pre_leases]
    if order == "reversed":
        results.reverse()
    seen = _statements(engine)
    c.commit(NAME, 1, begun.attempt.number, gen, results, "test")
    assert (len(seen) == 3) is (order == "by partition"), seen  # the decision, then the mark's two
    (decided,) = [ev for ev in c.list_events(NAME, batch_id=1) if ev["kind"] == "commit_decided"]
    won = [x for x in begun.pre_leases if x.partition != 1]
    assert decided["detail"] == hot_path.decision_event_detail(1, begun.attempt.number, [(x.partition, x.id) for x in won])
    assert decided["detail"]["winners"] == {"partitions": [0, 2], "lease_ids": [won[0].id, won[1].id]}


def test_begin_through_the_service_new_retried_and_refused(db_clock_coordinator: Coordinator, engine: Engine) -> None:
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    first = c.begin_checkpoint(NAME, 7, gen, "test", partitions=2, offsets_digest="d7")
    assert first.action is BeginAction.NEW_ATTEMPT and len(first.pre_leases) == 2
    assert first.checkpoint.created_at == first.attempt.started_at  # one time for the whole begin
    retried = c.begin_checkpoint(NAME, 7, gen, "test", partitions=2, offsets_digest="d7")
    assert retried.action is BeginAction.CONTINUE
    assert [x.id for x in retried.pre_leases] == [x.id for x in first.pre_leases]

    # a refused begin (a stale generation) leaves no checkpoint behind for a new batch
    newer, _ = c.start_generation(NAME, "q1", "r2", "test")
    with pytest.raises(e.Conflict):
        c.begin_checkpoint(NAME, 8, gen, "test", partitions=2)
    with engine.connect() as conn:
        assert conn.execute(select(checkpoints.c.batch_id)).scalars().all() == [7]

    results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50)) for x in first.pre_leases]
    with pytest.raises(e.Conflict):  # the old generation is fenced at commit too
        c.commit(NAME, 7, first.attempt.number, gen, results, "test")
    resumed = c.begin_checkpoint(NAME, 7, newer, "test", partitions=2, offsets_digest="d7")
    assert resumed.checkpoint.batch_id == 7 and resumed.attempt is not None


def test_the_committed_mark_is_two_statements_and_waits_for_every_winner(
    db_clock_coordinator: Coordinator, kafka: RecordingControlPlane, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")

    def winners_of(batch_id: int) -> tuple[int, list[PartitionResult]]:
        begun = c.begin_checkpoint(NAME, batch_id, gen, "test", partitions=2)
        return begun.attempt.number, [
            PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50)) for x in begun.pre_leases]

    number, results = winners_of(1)
    seen = _statements(engine)
    assert c.commit(NAME, 1, number, gen, results, "test").checkpoint.state is CheckpointState.COMMITTED
    # the decision's transaction (one statement: the locks, the clock after them, the decision), then
    # the mark's (lock, mark: sent together)
    assert [x.split()[0] for x in seen] == ["WITH", "SELECT", "WITH"], seen

    # Kafka commits one winner and not yet the other: the checkpoint stays COMMITTING
    number, results = winners_of(2)
    # an answer (one winner's transaction coordinator is loading): the other winner is committed
    kafka.fail_next(ControlPlaneError("coordinator loading", retriable=True, code="coordinator_load_in_progress"))
    with pytest.raises(e.Unavailable):  # decided; one winner still to commit on Kafka
        c.commit(NAME, 2, number, gen, results, "test")
    detail = c.checkpoint_detail(NAME, 2)
    cp, leases = detail.checkpoint, detail.leases
    assert sorted(x.state for x in leases) == [LeaseState.COMMITTED, LeaseState.COMMITTING]
    left = next(x for x in leases if x.state is LeaseState.COMMITTING)
    done = next(x for x in leases if x.state is LeaseState.COMMITTED)

    def mark(winner: Any, event_actor: str | None = None) -> hot_path.MarkedCommitted:
        with engine.begin() as conn:  # the mark is a transaction of its own, committed by its statement
            return hot_path.mark_committed(conn, sink_id=cp.sink_id, checkpoint_id=cp.id, attempt_id=left.attempt_id,
                                           done=[winner], now=None, event_actor=event_actor,
                                           event_detail={"by": "test"})

    # the statement checks its answer against the rule (it commits with its transaction): a broken
    # variant without the guard marks the attempt with a winner left, fails, and commits nothing
    with pytest.raises(DBAPIError, match="coordinator_assert: the checkpoint or attempt"):
        with monkeypatch.context() as patched:
            patched.setattr(hot_path, "_MARK_COMMITTED", _without(hot_path._MARK_COMMITTED, _LEASE_ROWS_GUARD))
            mark(done)
    assert c.checkpoint_detail(NAME, 2).checkpoint.state is CheckpointState.COMMITTING
    # the guard: naming only the winner already committed marks nothing
    kept = mark(done)
    assert kept.marked is None and kept.checkpoint.state is CheckpointState.COMMITTING
    assert {x.id: x.state for x in kept.leases}[left.id] is LeaseState.COMMITTING
    marked = mark(left, "recovery")
    assert marked.marked is not None and marked.marked[0].state is CheckpointState.COMMITTED
    assert marked.marked[0].committed_at == marked.now  # the database's clock, read after the lock
    assert all(x.state is LeaseState.COMMITTED for x in marked.leases)
    assert c.checkpoint_detail(NAME, 2).checkpoint.state is CheckpointState.COMMITTED
    # found COMMITTED under the lock: nothing is marked again, the winners come back as they are
    again = mark(left)
    assert again.marked is None and again.checkpoint.state is CheckpointState.COMMITTED
    assert all(x.state is LeaseState.COMMITTED for x in again.leases)
    # a transaction of its own: its synchronous_commit would apply to what came before
    with engine.begin() as conn, pytest.raises(ValueError, match="a transaction of its own"):
        conn.execute(select(1))
        hot_path.mark_committed(conn, sink_id=cp.sink_id, checkpoint_id=cp.id, attempt_id=left.attempt_id,
                                done=[left], now=None, event_actor=None, event_detail={})


@pytest.mark.parametrize("empty", [True, False], ids=["an-empty-partition", "every-partition-won"])
def test_the_committed_mark_of_first_tries_on_the_row_waits_for_every_winner(
    db_clock_coordinator: Coordinator, kafka: RecordingControlPlane, monkeypatch: pytest.MonkeyPatch, empty: bool
) -> None:
    """A decision whose first tries stay on the attempt's row (the coordinator stopped between the
    decision and Kafka): the mark checks them on the row, where a won partition not named in `done`
    keeps the attempt COMMITTING, and an empty partition's first try is answered ABORTED."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    begun = c.begin_checkpoint(NAME, 1, gen, "test", partitions=3)
    first = sorted(begun.pre_leases, key=lambda x: x.partition)
    results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50)) for x in first]
    if empty:
        results[2] = PartitionResult(2, None)
    last = LeaseState.ABORTED if empty else LeaseState.COMMITTED

    def stop(target: Any, txn: Any) -> None:
        raise RuntimeError("the coordinator stops between the decision and Kafka")

    with monkeypatch.context() as patched:
        patched.setattr(kafka, "commit", stop)
        with pytest.raises(RuntimeError):
            c.commit(NAME, 1, begun.attempt.number, gen, results, "test")
    detail = c.checkpoint_detail(NAME, 1)
    cp = detail.checkpoint
    assert cp.state is CheckpointState.COMMITTING
    on_row = {x.partition: x for x in detail.leases}
    assert [on_row[p].state for p in range(3)] == [
        LeaseState.COMMITTING, LeaseState.COMMITTING, LeaseState.ABORTED if empty else LeaseState.COMMITTING]
    with c.engine.connect() as conn:  # still on the row: no lease rows
        assert conn.execute(select(lease_rows.c.id)).all() == []

    def mark(*partitions: int) -> hot_path.MarkedCommitted:
        with c.engine.begin() as conn:
            return hot_path.mark_committed(conn, sink_id=cp.sink_id, checkpoint_id=cp.id, attempt_id=first[0].attempt_id,
                                           done=[on_row[p] for p in partitions], now=None, event_actor=None,
                                           event_detail={})

    # a broken variant without the first tries' guard marks the attempt with partition 1 left: the
    # statement's check of its answer fails, and nothing is committed
    with pytest.raises(DBAPIError, match="coordinator_assert: the checkpoint or attempt"):
        with monkeypatch.context() as patched:
            patched.setattr(hot_path, "_MARK_COMMITTED", _without(hot_path._MARK_COMMITTED, _FIRST_TRIES_GUARD))
            mark(0)
    kept = mark(0)
    assert kept.marked is None and c.checkpoint_detail(NAME, 1).checkpoint.state is CheckpointState.COMMITTING
    assert {x.partition: x.state for x in kept.leases} == {
        0: LeaseState.COMMITTING, 1: LeaseState.COMMITTING, 2: on_row[2].state}
    marked = mark(0, 1) if empty else mark(0, 1, 2)
    assert marked.marked is not None and marked.marked[0].state is CheckpointState.COMMITTED
    assert {x.partition: x.state for x in marked.leases} == {0: LeaseState.COMMITTED, 1: LeaseState.COMMITTED, 2: last}
    assert {x.partition: x.state for x in c.checkpoint_detail(NAME, 1).leases} == {
        0: LeaseState.COMMITTED, 1: LeaseState.COMMITTED, 2: last}
    with c.engine.connect() as conn:  # every id free again
        assert set(conn.execute(select(transactional_ids.c.state)).scalars()) == {"FREE"}


def test_a_finisher_that_finds_the_commit_marked_by_another_answers_it_committed(
    db_clock_coordinator: Coordinator, kafka: RecordingControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two finishers of one decided commit (a driver's resume and the recovery loop): the second
    to take the checkpoint's lock finds it COMMITTED. Its mark changes nothing and commits with its
    statement, so the attempt it answers with is read after that transaction."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    begun = c.begin_checkpoint(NAME, 1, gen, "test", partitions=2)
    results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50)) for x in begun.pre_leases]
    # an answer (one winner's transaction coordinator is loading): the other winner is committed
    kafka.fail_next(ControlPlaneError("coordinator loading", retriable=True, code="coordinator_load_in_progress"))
    with pytest.raises(e.Unavailable):  # decided; one winner still to commit on Kafka
        c.commit(NAME, 1, begun.attempt.number, gen, results, "test")
    commit_on_kafka, others = kafka.commit, []

    def commit_while_another_finishes(target: Any, txn: Any) -> None:
        commit_on_kafka(target, txn)
        if not others:  # between this finisher's Kafka commit and its mark, another finishes
            others.append(None)
            others[0] = c.resume(NAME, 1)

    monkeypatch.setattr(kafka, "commit", commit_while_another_finishes)
    answer = c.resume(NAME, 1)
    assert others[0].checkpoint.state is CheckpointState.COMMITTED
    assert answer.checkpoint.state is CheckpointState.COMMITTED and answer.attempt.state == "COMMITTED"
    assert sorted(x.state for x in answer.winners) == [LeaseState.COMMITTED] * 2
    assert answer.attempt.finished_at == others[0].attempt.finished_at  # as the other finisher left it


def _ran(engine: Engine) -> list[str]:
    """Which of the two committed marks run from now on, in order."""
    names = {hot_path._MARK_FIRST_TRIES_COMMITTED.sql: "first-tries mark", hot_path._MARK_COMMITTED.sql: "mark"}
    ran: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement in names:
            ran.append(names[statement])

    event.listen(engine, "before_cursor_execute", before)
    return ran


@pytest.mark.parametrize("empty", [True, False], ids=["an-empty-partition", "every-partition-won"])
def test_the_deciding_call_marks_its_first_tries_without_reading_the_row(
    db_clock_coordinator: Coordinator, engine: Engine, empty: bool
) -> None:
    """The common path's mark names the checkpoint's every lease (the winners and the first tries
    the decision ended unused) instead of reading them back: its answer is the one the record gives
    a retried commit, and the ids are free again."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    begun = c.begin_checkpoint(NAME, 1, gen, "test", partitions=3)
    results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50)) for x in begun.pre_leases]
    if empty:
        results[1] = PartitionResult(1, None)
    ran = _ran(engine)
    answer = c.commit(NAME, 1, begun.attempt.number, gen, results, "test")
    assert ran == ["first-tries mark"]
    assert answer.checkpoint.state is CheckpointState.COMMITTED and answer.attempt.state == "COMMITTED"
    assert [x.partition for x in answer.winners] == ([0, 2] if empty else [0, 1, 2])
    assert answer.aborts.aborted == ([begun.pre_leases[1].transactional_id] if empty else [])
    assert answer == c.commit(NAME, 1, begun.attempt.number, gen, results, "test")  # a retry: from the record
    assert ran == ["first-tries mark"]
    detail = c.checkpoint_detail(NAME, 1)
    assert sorted(answer.winners + [x for x in detail.leases if x.state is LeaseState.ABORTED],
                  key=lambda x: x.id) == detail.leases
    with c.engine.connect() as conn:
        assert set(conn.execute(select(transactional_ids.c.state)).scalars()) == {"FREE"}


def test_the_mark_of_first_tries_leaves_a_checkpoint_with_other_leases_to_the_general_mark(
    db_clock_coordinator: Coordinator, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An earlier attempt of the batch left its leases as lease rows: the first tries' mark finds
    them (its guard), changes nothing, and the general mark answers with them. A broken variant
    without that guard answers without the earlier attempt's aborted transactions."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")

    def commit_after_an_aborted_attempt(batch_id: int) -> tuple[Any, Any, Any]:
        first = c.begin_checkpoint(NAME, batch_id, gen, "test", partitions=2)
        c.abort_attempt(NAME, batch_id, first.attempt.number, gen, "driver gave up", "test")
        begun = c.begin_checkpoint(NAME, batch_id, gen, "test", partitions=2)
        results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50))
                   for x in begun.pre_leases]
        answer = c.commit(NAME, batch_id, begun.attempt.number, gen, results, "test")
        return first, answer, c.commit(NAME, batch_id, begun.attempt.number, gen, results, "test")

    ran = _ran(engine)
    first, answer, from_record = commit_after_an_aborted_attempt(1)
    assert ran == ["first-tries mark", "mark"]
    assert answer.checkpoint.state is CheckpointState.COMMITTED
    assert sorted(answer.aborts.aborted) == sorted(x.transactional_id for x in first.pre_leases)
    assert answer == from_record

    monkeypatch.setattr(hot_path, "_MARK_FIRST_TRIES_COMMITTED", _without(
        hot_path._MARK_FIRST_TRIES_COMMITTED,
        re.escape("AND NOT EXISTS (SELECT 1 FROM lease_rows WHERE checkpoint_id = :checkpoint_id)")))
    first, answer, from_record = commit_after_an_aborted_attempt(2)
    assert answer.aborts.aborted == [] and answer != from_record


def test_the_deciding_call_whose_commit_another_finisher_marked_answers_it_committed(
    db_clock_coordinator: Coordinator, kafka: RecordingControlPlane, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the deciding call's Kafka commit and its mark, a resume finishes the commit: the
    first tries' mark finds the checkpoint COMMITTED and changes nothing, and the general mark
    answers it as the other finisher left it."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    begun = c.begin_checkpoint(NAME, 1, gen, "test", partitions=2)
    results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50)) for x in begun.pre_leases]
    commit_on_kafka, others = kafka.commit, []

    def commit_while_another_finishes(target: Any, txn: Any) -> None:
        commit_on_kafka(target, txn)
        if not others:  # once: the resume's own Kafka commits come here too
            others.append(None)
            others[0] = c.resume(NAME, 1)

    monkeypatch.setattr(kafka, "commit", commit_while_another_finishes)
    ran = _ran(engine)
    answer = c.commit(NAME, 1, begun.attempt.number, gen, results, "test")
    assert ran == ["mark", "first-tries mark", "mark"]  # the resume's, then the call's two
    assert answer.checkpoint.state is CheckpointState.COMMITTED and answer.attempt.state == "COMMITTED"
    assert answer.attempt.finished_at == others[0].attempt.finished_at
    assert sorted(x.state for x in answer.winners) == [LeaseState.COMMITTED] * 2


def test_only_the_committed_mark_commits_without_waiting_for_the_wal_flush(
    db_clock_coordinator: Coordinator, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark records what Kafka already holds (a lost one is finished again), so its transaction
    alone commits asynchronously; begin's leases and the decision wait for the flush, and the
    setting does not outlive the mark's transaction on its pooled connection. Each of the three
    transactions commits with its last statement (driver_sql), so the setting is read in the same
    pipeline just before its COMMIT, and SQLAlchemy's commit after it finds nothing left to commit."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    last = {hot_path._NEW_ATTEMPT.sql: "begin", hot_path._BEGIN_NEW_BATCH.sql: "begin",
            hot_path._DECIDE_FIRST_TRIES.sql: "decision",
            hot_path._MARK_COMMITTED.sql: "mark", hot_path._MARK_FIRST_TRIES_COMMITTED.sql: "mark"}
    seen: list[tuple[str, str]] = []
    latest: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        latest[:] = [last.get(statement, "other")]

    pipelined = driver_sql._pipelined

    def reading_the_setting_before_commit(pgconn: Any, commands: list[tuple[bytes, Any]]) -> list[Any]:
        if commands[-1] != (driver_sql._SEND_QUERY, b"COMMIT"):
            return pipelined(pgconn, commands)
        results = pipelined(pgconn, [*commands[:-1], (driver_sql._SEND_QUERY, b"SHOW synchronous_commit"),
                                     commands[-1]])
        seen.append((latest[0], results[-2].get_value(0, 0).decode()))
        return [*results[:-2], results[-1]]

    def at_commit(conn: Any) -> None:
        status = conn.connection.driver_connection.pgconn.transaction_status
        seen.append(("commit", pq.TransactionStatus(status).name))

    monkeypatch.setattr(driver_sql, "_pipelined", reading_the_setting_before_commit)
    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "commit", at_commit)
    for batch_id in (1, 2):
        begun = c.begin_checkpoint(NAME, batch_id, gen, "test", partitions=2)
        results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50))
                   for x in begun.pre_leases]
        c.commit(NAME, batch_id, begun.attempt.number, gen, results, "test")
    event.remove(engine, "before_cursor_execute", before)
    event.remove(engine, "commit", at_commit)
    # batch 1 grows the pool: the one-statement begin commits nothing, then the two-statement one
    batch = [("begin", "on"), ("commit", "IDLE"), ("decision", "on"), ("commit", "IDLE"), ("mark", "off"), ("commit", "IDLE")]
    assert seen == [("begin", "on"), ("commit", "IDLE")] + batch * 2, seen
    assert c.checkpoint_detail(NAME, 2).checkpoint.state is CheckpointState.COMMITTED


def test_a_new_attempt_given_an_id_that_is_not_free_commits_nothing(
    db_clock_coordinator: Coordinator, engine: Engine
) -> None:
    """Begin's last statement commits with its transaction, so it checks in SQL what begin's locks
    promise: each id it hands out was FREE, and the checkpoint moved to the new attempt. A broken
    caller that hands out ids already leased fails it, and nothing of it stays."""
    c = db_clock_coordinator
    gen, _ = c.start_generation(NAME, "q1", "r1", "test")
    begun = c.begin_checkpoint(NAME, 1, gen, "test", partitions=2)
    with engine.connect() as conn:
        leased = [tuple(r) for r in conn.execute(
            select(transactional_ids.c.id, transactional_ids.c.transactional_id)
            .where(transactional_ids.c.state == "LEASED").order_by(transactional_ids.c.id))]
    assert len(leased) == 2
    with pytest.raises(DBAPIError, match="coordinator_assert: the checkpoint or a taken id"):
        with engine.begin() as conn:
            now = c.clock.now_in(conn)
            hot_path.insert_attempt_with_leases(
                conn, sink=c.get_sink(NAME), checkpoint_id=begun.checkpoint.id, number=2, generation=gen,
                partitions=2, now=now, taken=leased, deadline_at=now, commit=True)
    detail = c.checkpoint_detail(NAME, 1)
    assert detail.checkpoint.current_attempt == 1 and [a.number for a in detail.attempts] == [1]
