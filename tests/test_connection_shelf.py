"""The service's shelf of connections kept out of the pool between transactions
(coordinator/store/connections.py), on a real Postgres."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.service import Coordinator, SinkSpec
from coordinator.store.connections import ConnectionShelf
from coordinator.store.db import make_engine, sqlalchemy_url

_PID = text("SELECT pg_backend_pid()")


def _pid(conn: Connection) -> int:
    return conn.execute(_PID).scalar_one()


def _checkouts(engine: Engine) -> list[int]:
    counted = [0]

    def checkout(*_: Any) -> None:
        counted[0] += 1

    event.listen(engine.pool, "checkout", checkout)
    return counted


def _sessions(engine: Engine) -> set[int]:
    """The backends connected to the engine's database, other than the one asking."""
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url) as admin:
        return {pid for (pid,) in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")}


def test_the_next_transaction_reuses_the_connection_without_a_pool_checkout(engine: Engine) -> None:
    shelf = ConnectionShelf(engine, keep=2)
    with shelf.transaction() as conn:
        first = _pid(conn)
        conn.execute(text("CREATE TABLE shelf_probe (n int)"))
    checkouts = _checkouts(engine)
    for n in range(3):
        with shelf.transaction() as conn:
            assert _pid(conn) == first
            conn.execute(text("INSERT INTO shelf_probe VALUES (:n)"), {"n": n})
    assert checkouts == [0]
    assert shelf.idle() == 1
    with engine.connect() as other:  # each transaction committed as its block ended
        assert other.execute(text("SELECT count(*) FROM shelf_probe")).scalar_one() == 3


def test_a_block_that_raises_is_rolled_back_and_its_connection_shelved_clean(engine: Engine) -> None:
    shelf = ConnectionShelf(engine, keep=2)
    with shelf.transaction() as conn:
        conn.execute(text("CREATE TABLE shelf_probe (n int)"))
    with pytest.raises(ValueError, match="refused"), shelf.transaction() as conn:
        pid = _pid(conn)
        conn.execute(text("INSERT INTO shelf_probe VALUES (1)"))
        raise ValueError("refused")
    assert shelf.idle() == 1
    with shelf.transaction() as conn:
        assert _pid(conn) == pid
        assert conn.execute(text("SELECT count(*) FROM shelf_probe")).scalar_one() == 0


def test_at_most_keep_connections_wait_on_the_shelf_and_the_rest_go_back_to_the_pool(engine: Engine) -> None:
    shelf = ConnectionShelf(engine, keep=2)
    in_pool = engine.pool.checkedin()
    with ExitStack() as stack:  # five transactions at once
        pids = {_pid(stack.enter_context(shelf.transaction())) for _ in range(5)}
    assert len(pids) == 5
    assert shelf.idle() == 2
    assert engine.pool.checkedin() == in_pool + 3
    shelf.clear()
    assert shelf.idle() == 0 and engine.pool.checkedin() == in_pool + 5


def test_by_default_it_keeps_half_the_pool_and_nothing_for_a_pool_that_keeps_none(database_url: str) -> None:
    sized = make_engine(database_url, pool_size=6)  # 12 connections
    try:
        assert ConnectionShelf(sized).keep == 6
    finally:
        sized.dispose()
    unpooled = create_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    try:
        shelf = ConnectionShelf(unpooled)
        assert shelf.keep == 0
        with shelf.transaction() as conn:
            _pid(conn)
        assert shelf.idle() == 0
    finally:
        unpooled.dispose()


def test_a_dead_session_fails_its_transaction_once_and_empties_the_shelf(engine: Engine) -> None:
    shelf = ConnectionShelf(engine, keep=3)
    with ExitStack() as stack:
        pids = [_pid(stack.enter_context(shelf.transaction())) for _ in range(3)]
    assert shelf.idle() == 3
    with engine.connect() as admin:  # Postgres drops the shelved sessions (a restart, an admin)
        admin.execute(text("SELECT pg_terminate_backend(pid) FROM unnest(CAST(:pids AS int[])) AS pid"),
                      {"pids": pids})
    with pytest.raises(DBAPIError) as failed, shelf.transaction() as conn:
        _pid(conn)
    assert failed.value.connection_invalidated
    assert shelf.idle() == 0  # the other two were as dead: not handed to the next transactions
    with shelf.transaction() as conn:
        assert _pid(conn) not in pids


def test_a_connection_older_than_the_recycle_age_goes_back_to_the_pool(engine: Engine) -> None:
    shelf = ConnectionShelf(engine, keep=2, max_age_s=0)
    with shelf.transaction() as conn:
        _pid(conn)
    assert shelf.idle() == 0


def test_disposing_the_engine_closes_the_shelved_sessions(engine: Engine) -> None:
    shelf = ConnectionShelf(engine, keep=2)
    with ExitStack() as stack:
        pids = {_pid(stack.enter_context(shelf.transaction())) for _ in range(2)}
    assert shelf.idle() == 2 and pids <= _sessions(engine)
    engine.dispose()
    assert shelf.idle() == 0
    assert not pids & _sessions(engine)  # closed, not left in the old pool
    with shelf.transaction() as conn:  # the new pool's
        assert _pid(conn) not in pids


def test_the_coordinator_runs_its_transactions_on_its_shelf_and_empties_it_on_close(engine: Engine) -> None:
    coordinator = Coordinator(engine, RecordingControlPlane())
    coordinator.register_sink(SinkSpec("shelf", "shelf-", "kafka:9092", ["out"]), "test", check_broker=False)
    assert coordinator.connections.idle() == 1
    checkouts = _checkouts(engine)
    assert coordinator._tx(_pid) == coordinator._tx(_pid)
    assert checkouts == [0]
    coordinator.close()
    assert coordinator.connections.idle() == 0


def test_every_coordinator_on_an_engine_shares_its_shelf(engine: Engine, database_url: str) -> None:
    """A coordinator object dropped without close (the simulation's crashed replica) holds no
    connection of its own: the next one on the engine takes the shelved ones."""
    first, second = Coordinator(engine, RecordingControlPlane()), Coordinator(engine, RecordingControlPlane())
    assert first.connections is second.connections is ConnectionShelf.of(engine)
    other = make_engine(database_url, pool_size=2)
    try:
        assert ConnectionShelf.of(other) is not ConnectionShelf.of(engine)
    finally:
        other.dispose()
    first.close()
    second.close()
