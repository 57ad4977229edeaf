"""The hot path's statements run on psycopg directly (coordinator/store/driver_sql.py), and still
behave as SQLAlchemy statements do where it matters: errors of the same kind, a dead pooled
connection retried, the statement listeners (the simulation's fault points) fired. Real Postgres."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import pq
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import DBAPIError, IntegrityError

from coordinator.kafka.control_plane import ControlPlaneError
from coordinator.protocol import errors as e
from coordinator.protocol.model import Lease, PartitionResult, PrecommitRecord
from coordinator.service import Coordinator, SinkSpec
from coordinator.store.driver_sql import DriverStatement, run_together

NAME = "orders"


def _started(c: Coordinator) -> int:
    """The test's sink registered and a query started on it: its generation."""
    c.register_sink(SinkSpec(NAME, "orders-eos", "kafka:9092", ["out"]), "test")
    generation, _ = c.start_generation(NAME, "q", "r", "test")
    return generation


def _cycle(c: Coordinator, generation: int, batch_id: int, partitions: int = 2) -> None:
    """One batch committed, each partition's record with its write time and a first offset."""
    begun = c.begin_checkpoint(NAME, batch_id, generation, "test", partitions=partitions)
    results = [PartitionResult(x.partition, x.id, PrecommitRecord(1000 + x.partition, 0, 5, 50, 3,
                                                                  [["out", x.partition, batch_id]]))
               for x in begun.pre_leases]
    assert c.commit(NAME, batch_id, begun.attempt.number, generation, results, "test").checkpoint.state == "COMMITTED"


def test_parameters_rows_and_casts(engine: Engine) -> None:
    stmt = DriverStatement("SELECT :a::int + 1 AS b, CAST(:xs AS int[]) AS xs, 'x:y' AS literal")
    with engine.begin() as conn:
        assert [r.as_dict() for r in stmt.rows(conn, {"a": "41", "xs": [1, 2]})] == [{"b": 42, "xs": [1, 2], "literal": "x:y"}]
        assert DriverStatement("SELECT 1 AS one WHERE false").first(conn, {}) is None
        with pytest.raises(AssertionError):
            DriverStatement("SELECT generate_series(1, 2) AS n").one(conn, {})
    with pytest.raises(ValueError):
        DriverStatement("SELECT 10 % 3")


def test_an_error_is_sqlalchemys_of_the_same_kind_and_the_transaction_rolls_back(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY)"))
    insert = DriverStatement("INSERT INTO t VALUES (:id) RETURNING id")
    with pytest.raises(IntegrityError) as caught:
        with engine.begin() as conn:
            assert [r["id"] for r in insert.rows(conn, {"id": 1})] == [1]
            insert.rows(conn, {"id": 1})
    assert caught.value.orig.sqlstate == "23505" and not caught.value.connection_invalidated
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 0


def test_statement_listeners_fire_for_driver_statements(engine: Engine) -> None:
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        with engine.begin() as conn:
            DriverStatement("SELECT :n AS n").rows(conn, {"n": 1})
    finally:
        event.remove(engine, "before_cursor_execute", before)
    assert seen == ["SELECT %(n)s AS n"]


def test_a_statement_runs_in_the_callers_transaction_started_as_psycopg_starts_it(engine: Engine) -> None:
    """The driver starts the transaction itself (BEGIN with the connection's options) when its
    statement comes first; SQLAlchemy's rollback undoes what it wrote, its commit keeps it."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY)"))
    insert = DriverStatement("INSERT INTO t VALUES (:id) RETURNING id, txid_current() AS tx, "
                             "current_setting('transaction_isolation') AS isolation")
    with engine.connect() as conn:
        rolled_back = conn.begin()
        first = insert.one(conn, {"id": 1})
        second = insert.one(conn, {"id": 2})
        assert first["tx"] == second["tx"] and first["isolation"] == "read committed"
        rolled_back.rollback()
        with conn.begin():
            third = insert.one(conn, {"id": 3})
        assert third["tx"] != first["tx"]
    with engine.connect().execution_options(isolation_level="SERIALIZABLE") as conn, conn.begin():
        assert insert.one(conn, {"id": 4})["isolation"] == "serializable"
        conn.get_transaction().rollback()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        autocommitted = insert.one(conn, {"id": 5})
        assert insert.one(conn, {"id": 6})["tx"] != autocommitted["tx"]  # each statement its own
    with engine.connect() as conn:
        assert conn.execute(text("SELECT array_agg(id ORDER BY id) FROM t")).scalar_one() == [3, 5, 6]


def test_a_statement_is_prepared_once_per_session_and_again_after_a_deallocate(engine: Engine) -> None:
    """Prepared at its first execution, then reused; after a DEALLOCATE the driver did not make
    (psycopg's after a rollback, on an engine where psycopg prepares too) the statement fails
    with InvalidSqlStatementName, and the next execution prepares it again."""
    stmt = DriverStatement("SELECT :n + 1 AS next")
    named = "SELECT count(*) FROM pg_prepared_statements WHERE statement = 'SELECT $1 + 1 AS next'"
    with engine.connect() as conn:
        assert [stmt.one(conn, {"n": n})["next"] for n in range(5)] == [1, 2, 3, 4, 5]
        assert conn.execute(text(named)).scalar_one() == 1
        conn.commit()
        conn.exec_driver_sql("DEALLOCATE ALL")
        conn.commit()
        with pytest.raises(DBAPIError) as caught:
            stmt.one(conn, {"n": 1})
        assert caught.value.orig.sqlstate == "26000" and not caught.value.connection_invalidated
        conn.rollback()
        assert stmt.one(conn, {"n": 41})["next"] == 42
        assert conn.execute(text(named)).scalar_one() == 1


def test_after_psycopg_deallocates_at_a_rollback_the_next_call_prepares_again_without_failing(
    coordinator: Coordinator, engine: Engine
) -> None:
    """psycopg prepares SQLAlchemy's repeated statements too, and sends DEALLOCATE ALL when it
    rolls back an open transaction: the driver's statements go with them. The rollback marks the
    session's record stale, so the next call prepares them again instead of failing on them."""
    generation = _started(coordinator)
    _cycle(coordinator, generation, 1)
    count = text("SELECT count(*) FROM pg_prepared_statements")
    coordinator.connections.clear()  # the sessions the service keeps out of the pool go back to it
    with ExitStack() as stack:  # every pooled session at once
        conns = [stack.enter_context(engine.connect()) for _ in range(engine.pool.checkedin())]
        assert sum(c.execute(count).scalar_one() for c in conns) >= 5  # the batch's statements
        for conn in conns:
            for _ in range(6):  # psycopg prepares a statement at its 5th execution
                conn.execute(text("SELECT 1"))
            conn.rollback()
            assert conn.execute(count).scalar_one() == 0  # psycopg's DEALLOCATE ALL
            conn.rollback()
    errors: list[BaseException] = []

    def failed(context: Any) -> None:
        errors.append(context.original_exception)

    event.listen(engine, "handle_error", failed)
    try:
        _cycle(coordinator, generation, 2)
    finally:
        event.remove(engine, "handle_error", failed)
    assert errors == []


def test_a_deallocate_nobody_announced_fails_the_transaction_once_and_it_is_retried(
    coordinator: Coordinator, engine: Engine
) -> None:
    generation = _started(coordinator)
    _cycle(coordinator, generation, 1)
    coordinator.connections.clear()
    sessions = [engine.pool.connect() for _ in range(engine.pool.checkedin())]  # every pooled one
    lost = 0
    for pooled in sessions:  # straight on psycopg: no SQLAlchemy rollback tells the driver
        raw = pooled.driver_connection
        lost += raw.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0]
        raw.execute("DEALLOCATE ALL")
        raw.commit()
        pooled.close()
    assert lost >= 5  # the batch's statements had been prepared
    _cycle(coordinator, generation, 2)


def test_a_protocol_call_on_a_dead_pooled_connection_is_retried(coordinator: Coordinator, engine: Engine) -> None:
    """Postgres restarts or drops the session between two calls: the next call's first statement
    (a driver statement) fails on the dead connection, and the transaction is retried on a new one.
    The next call takes the connection the service kept out of the pool, dead too."""
    generation = _started(coordinator)
    _cycle(coordinator, generation, 1)
    assert coordinator.connections.idle() >= 1
    pooled = engine.pool.checkedin() + coordinator.connections.idle()
    with psycopg.connect(engine.url.set(drivername="postgresql").render_as_string(hide_password=False)) as admin:
        (killed,) = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert pooled >= 1 and killed >= pooled
    _cycle(coordinator, generation, 2)


def test_a_dead_connection_is_reported_as_invalidated(engine: Engine) -> None:
    with engine.connect() as victim:
        pid = victim.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(DBAPIError) as caught:
            DriverStatement("SELECT 1 AS one").rows(victim, {})
    assert caught.value.connection_invalidated


def test_rows_are_read_by_name_and_records_built_by_position_match_those_built_by_name(engine: Engine) -> None:
    c = Coordinator(engine, None)
    generation = _started(c)
    c.begin_checkpoint(NAME, 1, generation, "test", partitions=2)
    joined = DriverStatement("SELECT 7 AS x_id, l.id AS l_id, l.* FROM leases AS l ORDER BY l.id")
    with engine.begin() as conn:
        rows = joined.rows(conn, {})
    assert len(rows) == 2 and rows[0]["x_id"] == 7 and rows[0][0] == 7 and rows[1]["l_id"] > rows[0]["l_id"]
    with pytest.raises(KeyError):
        rows[0]["no_such_column"]
    by_position = [Lease.from_mapping(r) for r in rows]
    by_name = [Lease.from_mapping(r.as_dict()) for r in rows]
    assert by_position == by_name and [x.partition for x in by_position] == [0, 1]
    assert by_position[0].state.value == "LEASED" and by_position[0].id == rows[0]["l_id"]


@pytest.mark.parametrize("partitions", [2, 40])
def test_a_batchs_statements_run_prepared_whatever_its_partition_count(database_url: str, partitions: int) -> None:
    # Until the tenth round, statements over more than 16 rows ran unprepared (planned for their
    # values), which cost a 200-partition batch ~4 ms of Postgres planning; their plans now reach
    # rows by key for any count (test_plans_reach_rows_by_index_whatever_the_state_statistics).
    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Limits
    from coordinator.store.db import sqlalchemy_url
    from sqlalchemy import create_engine

    engine = create_engine(sqlalchemy_url(database_url), pool_size=1, max_overflow=0)  # one session to look at
    c = Coordinator(engine, RecordingControlPlane(), limits=Limits(max_partitions=256))
    try:
        generation = _started(c)
        for batch_id in range(8):
            _cycle(c, generation, batch_id, partitions)
        with engine.connect() as conn:
            statements = conn.execute(text("SELECT statement FROM pg_prepared_statements")).scalars().all()
    finally:
        c.close()
        engine.dispose()
    marks = ("INSERT INTO attempts", "first_records = $", "SET state = 'COMMITTED', resolved_at")
    sized = [s for s in statements if any(m in s for m in marks)]
    assert len(sized) == len(marks), sized
    assert any("FOR SHARE OF s FOR UPDATE OF c, a" in s for s in statements)


def test_array_literals_read_back_as_the_lists_they_were_made_from(engine: Engine) -> None:
    """int_array / text_array (array parameters as one text literal, not psycopg's per-element
    list dumper) against Postgres' own parser: random strings with quotes, backslashes, commas,
    braces, spaces, NULL-looking words and non-ASCII, and integers across bigint's range."""
    import random

    from coordinator.store.driver_sql import int_array, text_array

    rng = random.Random(12)
    alphabet = ['"', "\\", ",", "{", "}", " ", "\t", "'", "a", "Z", "0", "é", "日", "NULL", ":", "%"]
    stmt = DriverStatement("SELECT CAST(:ints AS bigint[]) AS ints, CAST(:texts AS text[]) AS texts")
    with engine.begin() as conn:
        for _ in range(300):
            ints = [rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randint(-10**12, 10**12)])
                    for _ in range(rng.randint(0, 8))]
            texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 8))]
            row = stmt.one(conn, {"ints": int_array(ints), "texts": text_array(texts)})
            assert (row["ints"], row["texts"]) == (ints, texts)
    with pytest.raises(TypeError):
        int_array([1.5])  # type: ignore[list-item]


@pytest.mark.parametrize("partitions", [2, 40])
def test_plans_reach_rows_by_index_whatever_the_state_statistics(database_url: str, partitions: int) -> None:
    """Every statement of a query's start and of its batches (begin and commit; and commits that
    Kafka failed once, finished by a resume: the general committed mark), planned as it runs
    (prepared: the generic plan, forced) over a deployment's statistics: 12,000 committed leases
    and 10,000 free ids of 25 other sinks. None scans a whole table that grows with history or with
    other sinks (the release of a resumed commit's ids hashed the whole pool at 40 ids). The hot path's
    writes compare a state (`state = 'LEASED'`, ...) that such statistics say almost no row has;
    before they named their rows' keys as arrays, the decision's generic plan scanned every lease,
    and the committed mark's plan for 40 ids scanned every id (and re-read its pairs once per id)."""
    import re

    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Limits
    from coordinator.store.db import sqlalchemy_url
    from psycopg import ClientCursor
    from sqlalchemy import create_engine

    from bench.measure import plain_url, seed_history

    engine = create_engine(sqlalchemy_url(database_url), pool_size=1, max_overflow=0)  # one session to look at
    seen: dict[str, dict[str, Any]] = {}  # each statement a batch ran, with the parameters of its last run

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if isinstance(parameters, dict):
            seen[statement] = dict(parameters)

    control_plane = RecordingControlPlane()
    c = Coordinator(engine, control_plane, limits=Limits(max_partitions=256))
    try:
        c.register_sink(SinkSpec(NAME, "orders-eos", "kafka:9092", ["out"]), "test")
        event.listen(engine, "before_cursor_execute", record)
        generation, _ = c.start_generation(NAME, "q", "r", "test")  # a query's start, and its restarts
        for batch_id in range(6):  # psycopg prepares a statement at its 5th execution
            _cycle(c, generation, batch_id, partitions)
        for batch_id in range(6, 12):  # and the general committed mark: a commit finished by a resume
            control_plane.fail_next(ControlPlaneError("broker unreachable", retriable=True, code="network_exception"))
            with pytest.raises(e.Unavailable):
                _cycle(c, generation, batch_id, partitions)
            assert c.resume(NAME, batch_id).checkpoint.state == "COMMITTED"
        event.remove(engine, "before_cursor_execute", record)
        seed_history(database_url, "plans", checkpoints=3000, partitions=4)
        with psycopg.connect(plain_url(database_url), autocommit=True) as other:
            for n in range(25):
                c.register_sink(SinkSpec(f"other-{n}", f"other-{n}-eos", "kafka:9092", ["out"]), "test")
            other.execute("INSERT INTO transactional_ids (sink_id, ordinal, transactional_id, state, released_at) "
                          "SELECT s.id, g, s.transactional_id_prefix || g, 'FREE', now() "
                          "FROM sinks s, generate_series(0, 399) g WHERE s.name LIKE 'other-%'")
            other.execute("ANALYZE")
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            raw.execute("SET plan_cache_mode = force_generic_plan")  # for the prepared ones
            prepared = dict(raw.execute("SELECT statement, name FROM pg_prepared_statements").fetchall())
            scans: dict[str, list[str]] = {}
            for statement, params in seen.items():
                order: list[str] = []  # psycopg numbers the parameters by first appearance
                for name in re.findall(r"%\((\w+)\)s", statement):
                    if name not in order:
                        order.append(name)
                numbered = statement
                for i, name in enumerate(order):
                    numbered = numbered.replace(f"%({name})s", f"${i + 1}")
                if numbered in prepared:
                    args = ClientCursor(raw).mogrify(", ".join(["%s"] * len(order)), [params[n] for n in order])
                    (plan,) = raw.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {prepared[numbered]}({args})").fetchone()
                elif statement.lstrip().startswith(("WITH", "SELECT", "UPDATE")):
                    (plan,) = raw.execute(f"EXPLAIN (FORMAT JSON) {statement}", params, prepare=False).fetchone()
                else:
                    continue
                nodes, found = [plan[0]["Plan"]], []
                while nodes:
                    node = nodes.pop()
                    nodes += node.get("Plans", [])
                    # sinks: one row each; generations: one row per query start
                    if node["Node Type"] == "Seq Scan" and node["Relation Name"] not in ("sinks", "generations"):
                        found.append(node["Relation Name"])
                scans[" ".join(statement.split())] = found
    finally:
        c.close()
        engine.dispose()
    hot = ("INSERT INTO attempts (", "first_records = %(records)s", "SET state = 'COMMITTED', resolved_at",
           "SET state = 'COMMITTED', finished_at", "FOR UPDATE SKIP LOCKED", "FOR SHARE OF s FOR UPDATE OF c, a")
    assert all(any(h in s for s in scans) for h in hot), sorted(scans)  # the hot path's statements were looked at
    assert {s[:120]: found for s, found in scans.items() if found} == {}


def test_the_pool_querys_generic_plan_reads_a_sinks_ids_by_index_whatever_the_statistics_saw(engine: Engine) -> None:
    """Statistics taken while one sink had all the ids (a first large sink) say any sink has them
    all: the generic plan of the pool query then scanned the whole table (~4 ms per begin at
    40,000 ids). Migration 0016 tells the planner a sink has a few ids."""
    from coordinator.store.repo import FREE_IDS

    with engine.begin() as conn:
        conn.execute(text("INSERT INTO sinks (name, transactional_id_prefix, bootstrap_servers, topics, "
                          "transaction_timeout_ms, commit_margin_ms, max_pool_size, generation, created_at, "
                          "writer_token_version) SELECT 'large-' || g, 'large-' || g || '-', 'kafka:9092', '[]', "
                          "60000, 5000, 50000, 0, now(), 0 FROM generate_series(1, 2) g"))
        conn.execute(text("INSERT INTO transactional_ids (sink_id, ordinal, transactional_id, state, released_at) "
                          "SELECT s.id, g, s.transactional_id_prefix || g, 'FREE', now() "
                          "FROM sinks s, generate_series(0, 29999) g WHERE s.name = 'large-1'"))
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE transactional_ids"))
        raw = conn.connection.driver_connection
        raw.execute(f"PREPARE pool AS {FREE_IDS._query.decode()}")
        raw.execute("SET plan_cache_mode = force_generic_plan")
        plans = ["\n".join(r[0] for r in raw.execute(f"EXPLAIN EXECUTE pool('large-2', now(), {batch}, 2)"))
                 for batch in ("NULL", "7")]  # as a lease takes one, and as begin's first statement
    for plan in plans:
        assert "Index Scan using uq_transactional_ids_sink_id_ordinal" in plan and "Seq Scan" not in plan, plan


def test_no_statement_of_a_batch_is_planned_anew_at_each_run(database_url: str) -> None:
    """Postgres plans a prepared statement for the values given (a custom plan) at each of its
    first five runs, then keeps doing so whenever it estimates its generic plan costlier; the
    statements it did that for run their generic plan (`generic_plan`). Over a history (3,000
    committed batches and 20,000 ids of another sink), 12 batches of 2, then of 40 partitions, on
    one session: no driver statement got more than its first five custom plans, and the statements
    that force their generic plan got none."""
    from coordinator.kafka.control_plane import RecordingControlPlane
    from coordinator.service import Limits
    from coordinator.store.db import sqlalchemy_url
    from coordinator.store.hot_path import (
        _BEGIN_NEW_BATCH,
        _DECIDE_FIRST_TRIES,
        _MARK_FIRST_TRIES_COMMITTED,
        _NEW_ATTEMPT,
    )
    from coordinator.store.repo import FREE_IDS
    from sqlalchemy import create_engine

    from bench.measure import seed_history

    seed_history(database_url, "plans", checkpoints=3000, partitions=4, ids=20_000)
    engine = create_engine(sqlalchemy_url(database_url), pool_size=1, max_overflow=0)  # one session to look at
    c = Coordinator(engine, RecordingControlPlane(), limits=Limits(max_partitions=256))
    try:
        c.register_sink(SinkSpec(NAME, "orders-eos", "kafka:9092", ["out"]), "test")
        generation, _ = c.start_generation(NAME, "q", "r", "test")
        for batch_id in range(24):
            _cycle(c, generation, batch_id, 2 if batch_id < 12 else 40)
        with engine.connect() as conn:
            # by SQL: a statement is prepared once per set of parameter types (a null's is unknown)
            plans = {statement: (generic, custom) for statement, generic, custom in conn.exec_driver_sql(
                "SELECT statement, sum(generic_plans), max(custom_plans) FROM pg_prepared_statements "
                "WHERE starts_with(name, 'driver_sql_') GROUP BY statement")}
    finally:
        c.close()
        engine.dispose()
    every_batch = {s._query.decode() for s in (_BEGIN_NEW_BATCH, _DECIDE_FIRST_TRIES, _MARK_FIRST_TRIES_COMMITTED)}
    forced = every_batch | {s._query.decode() for s in (FREE_IDS, _NEW_ATTEMPT)}  # these two: when the pool grows
    assert forced <= set(plans)
    assert {s[:100]: n for s, n in plans.items() if n[1] > (0 if s in forced else 5)} == {}
    assert all(plans[s][0] >= 24 for s in every_batch)


def test_a_generic_plan_statement_runs_its_generic_plan_and_only_it(engine: Engine) -> None:
    """The setting is the transaction's for that statement alone: the next statement of the same
    send, and a statement of SQLAlchemy's after it, see the session's own; and with the COMMIT
    sent after it, the session's setting is as before."""
    setting = "SELECT current_setting('plan_cache_mode') AS mode"
    generic, plain = DriverStatement(setting, generic_plan=True), DriverStatement(setting)
    with engine.connect() as conn:
        with conn.begin():
            assert [rows[0]["mode"] for rows in run_together(conn, [(generic, {}), (plain, {})])] \
                == ["force_generic_plan", "auto"]
            assert conn.execute(text(setting)).scalar_one() == "auto"
        with conn.begin():
            assert generic.one(conn, {}, commit=True)["mode"] == "force_generic_plan"
        assert conn.execute(text(setting)).scalar_one() == "auto"


@contextmanager
def _sends(conn: Any) -> Iterator[list[list[str]]]:
    """What the client sends on conn's session, from libpq's protocol trace: one list of messages
    per send, that is per round trip (the messages sent before the next answer is read)."""
    pgconn = conn.connection.driver_connection.pgconn
    sends: list[list[str]] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield sends
        finally:
            pgconn.untrace()
            trace.seek(0)
            previous = "B"
            for line in trace.read().splitlines():
                direction, _, kind, *rest = line.split("\t")
                if direction == "F":
                    if previous != "F":
                        sends.append([])
                    if kind in ("Parse", "Query"):  # with the first word of its SQL
                        kind += " " + rest[0].split('"')[-2 if kind == "Query" else 3].split()[0]
                    sends[-1].append(kind)
                previous = direction


def test_begin_prepare_execute_and_commit_travel_in_one_round_trip(engine: Engine) -> None:
    """A transaction's first driver statement carries the BEGIN (and its PREPARE, the first time);
    with commit=True it also carries the COMMIT, and SQLAlchemy's commit then sends nothing."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY)"))
    insert = DriverStatement("INSERT INTO t VALUES (:id) RETURNING id")
    count = text("SELECT count(*) FROM t")
    with engine.connect() as conn, _sends(conn) as sent:
        with conn.begin():
            assert insert.one(conn, {"id": 1}, commit=True)["id"] == 1
            with engine.connect() as other:  # committed before SQLAlchemy's commit
                assert other.execute(count).scalar_one() == 1
        with conn.begin():
            insert.one(conn, {"id": 2})
    assert [[m for m in s if m.split()[0] in ("Parse", "Execute", "Sync", "Query")] for s in sent] == [
        ["Parse BEGIN", "Execute", "Parse INSERT", "Execute", "Parse COMMIT", "Execute", "Sync"],
        ["Parse BEGIN", "Execute", "Execute", "Sync"],  # the statement prepared already
        ["Query COMMIT"],  # SQLAlchemy's, sent by psycopg
    ], sent
    with engine.connect() as conn:
        assert conn.execute(count).scalar_one() == 2


def test_statements_run_together_in_one_round_trip_each_with_its_own_snapshot(engine: Engine) -> None:
    """`run_together` sends BEGIN, the statements (each prepared the first time) and the COMMIT in
    one round trip. Each statement still takes its snapshot as it starts: the one after a lock
    wait sees what the lock's holder committed meanwhile (the committed mark's lock, then mark)."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY, v int)"))
        conn.execute(text("INSERT INTO t VALUES (1, 0)"))
    lock = DriverStatement("SELECT v FROM t WHERE id = :id FOR UPDATE")
    read = DriverStatement("SELECT v, (SELECT count(*) FROM t) AS n FROM t WHERE id = :id")
    with engine.connect() as holder:
        holder.execute(text("UPDATE t SET v = 1 WHERE id = 1"))  # holds the row's lock
        answers: list[Any] = []
        with engine.connect() as conn, _sends(conn) as sent:

            def together() -> None:
                with conn.begin():
                    answers.append(run_together(conn, ((lock, {"id": 1}), (read, {"id": 1})), commit=True))

            waiting = threading.Thread(target=together)
            waiting.start()
            with engine.connect() as watcher:  # the pipeline has reached the lock and waits there
                deadline = time.monotonic() + 10
                while not watcher.execute(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")).scalar_one():
                    assert time.monotonic() < deadline, "the first statement never waited for the lock"
                    time.sleep(0.01)
            assert not answers
            holder.execute(text("INSERT INTO t VALUES (2, 0)"))
            holder.commit()
            waiting.join(10)
        ((locked,), (after,)) = answers[0]
        assert locked["v"] == 1 and (after["v"], after["n"]) == (1, 2)  # both committed by the holder meanwhile
        assert [[m for m in s if m.split()[0] in ("Parse", "Execute", "Sync", "Query")] for s in sent] == [
            ["Parse BEGIN", "Execute", "Parse SELECT", "Execute", "Parse SELECT", "Execute", "Parse COMMIT", "Execute",
             "Sync"],
        ], sent


def test_statements_run_together_stop_at_the_first_failure_which_names_its_statement(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY)"))
    insert = DriverStatement("INSERT INTO t VALUES (:id) RETURNING id")
    checked = DriverStatement("SELECT coordinator_assert(:ok, 'not ok') AS ok")
    for statements, failing in (
        (((checked, {"ok": False}), (insert, {"id": 1})), checked),
        (((insert, {"id": 1}), (checked, {"ok": False})), checked),
        (((insert, {"id": 1}), (insert, {"id": 1})), insert),
    ):
        with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
            run_together(conn, statements, commit=True)
        assert caught.value.statement == failing.sql
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 0  # nothing committed
        assert [r["ok"] for r in checked.rows(conn, {"ok": True})] == [True]
        assert run_together(conn, ((insert, {"id": 1}), (insert, {"id": 2})), commit=True) == [[(1,)], [(2,)]]


def test_a_statement_after_the_one_its_transaction_committed_with_is_refused(engine: Engine) -> None:
    stmt = DriverStatement("SELECT 1 AS one")
    with engine.connect() as conn:
        conn.begin()
        stmt.rows(conn, {}, commit=True)
        with pytest.raises(AssertionError, match="after the one its transaction committed with"):
            stmt.rows(conn, {})
        with pytest.raises(AssertionError, match="after the one its transaction committed with"):
            conn.execute(text("SELECT 2"))
        conn.commit()
        with conn.begin(), conn.begin_nested(), pytest.raises(ValueError, match="savepoint"):
            stmt.rows(conn, {}, commit=True)  # would commit the outer transaction too
        with conn.begin():  # the next transaction on the same session is a new one
            assert stmt.one(conn, {})["one"] == 1
            assert conn.execute(text("SELECT 2")).scalar_one() == 2


def test_a_statement_that_fails_commits_nothing_even_when_it_carried_the_commit(engine: Engine) -> None:
    """The COMMIT after a failed statement does not run: the transaction rolls back whole, be the
    failure a Postgres error or the statement's own check (coordinator_assert)."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY)"))
    insert = DriverStatement("INSERT INTO t VALUES (:id) RETURNING id")
    checked = DriverStatement("INSERT INTO t VALUES (:id) RETURNING coordinator_assert(id < 10, 'id too large') AS ok")
    with pytest.raises(IntegrityError):
        with engine.begin() as conn:
            insert.rows(conn, {"id": 1})
            insert.rows(conn, {"id": 1}, commit=True)
    with pytest.raises(DBAPIError) as caught:
        with engine.begin() as conn:
            insert.rows(conn, {"id": 2})
            checked.rows(conn, {"id": 11}, commit=True)
    assert caught.value.orig.sqlstate == "XX000" and "coordinator_assert: id too large" in str(caught.value.orig)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 0
        assert checked.one(conn, {"id": 3}, commit=True)["ok"] is True
    with engine.connect() as conn:
        assert conn.execute(text("SELECT array_agg(id) FROM t")).scalar_one() == [3]


def test_waiting_for_postgres_leaves_the_gil_to_other_threads(engine: Engine) -> None:
    """psycopg's get_result keeps the GIL while libpq waits for the answer; the driver waits with it
    released, as psycopg's exec_ calls do, or every other thread of the server stops meanwhile."""
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    sleeper = DriverStatement("SELECT pg_sleep(:s) AS slept")
    with engine.connect() as conn:
        ticker = threading.Thread(target=tick)
        ticker.start()
        try:
            started = time.monotonic()
            with conn.begin():  # BEGIN, PREPARE and the statement in one pipeline
                sleeper.rows(conn, {"s": 1.0})
            ended = time.monotonic()
        finally:
            stop.set()
            ticker.join()
    during = [t for t in ticks if started <= t <= ended]
    gaps = [b - a for a, b in zip([started, *during], [*during, ended])]
    assert ended - started >= 1.0 and max(gaps) < 0.5, max(gaps)


def test_a_statement_larger_than_the_sockets_buffers_is_sent_whole(engine: Engine) -> None:
    """psycopg's connections are non-blocking: a pipeline's sends can leave part of a large
    statement queued in libpq, and waiting for its answer before sending the rest would wait
    forever. (In a thread, so that such a hang fails the test instead of stopping it.)"""
    big = "x" * (8 << 20)
    answer: list[int] = []

    def run() -> None:
        with engine.begin() as conn:  # a new transaction: BEGIN, PREPARE and the statement in one pipeline
            answer.append(DriverStatement("SELECT length(:big) AS n").one(conn, {"big": big}, commit=True)["n"])

    sender = threading.Thread(target=run, daemon=True)
    sender.start()
    sender.join(30)
    assert not sender.is_alive(), "the statement was never sent whole"
    assert answer == [len(big)]


def test_the_pipeline_is_sent_with_the_gil_released_where_libpq_is_found(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psycopg's pipeline_sync keeps the GIL while it sends; the driver calls libpq's own through
    ctypes (which releases it) when the libpq psycopg uses is the one mapped in the process, as
    with psycopg's binary wheel on Linux, and falls back to psycopg's otherwise."""
    from coordinator.store import driver_sql

    assert driver_sql._libpq_pipeline_sync() is not None  # this machine: Linux, psycopg[binary]
    stmt = DriverStatement("SELECT CAST(:n AS int) * 2 AS twice")
    with engine.begin() as conn:
        assert stmt.one(conn, {"n": 21}, commit=True)["twice"] == 42
    assert driver_sql._PIPELINE_SYNC not in (None, False)
    monkeypatch.setattr(driver_sql, "_PIPELINE_SYNC", False)  # psycopg's pipeline_sync
    with engine.begin() as conn:
        assert stmt.one(conn, {"n": 4}, commit=True)["twice"] == 8
