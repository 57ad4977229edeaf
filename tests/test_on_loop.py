"""Calls run on the event loop (coordinator/on_loop.py): their waits let the loop run other calls,
and nothing that would block the loop's thread runs there. The database cases run on a real
Postgres, through the driver statements the protocol's common path uses."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import Engine, text

from coordinator import on_loop
from coordinator.store.db import make_engine
from coordinator.store.driver_sql import DriverStatement


def _on_loop(*calls: Any, timeout: float = 20) -> tuple[list[Any], int]:
    """Each call run on one loop at once; their results and the loop's thread."""

    async def main() -> list[Any]:
        return list(await asyncio.wait_for(asyncio.gather(*(on_loop.run_on_loop(c) for c in calls)), timeout))

    got: list[Any] = []
    loop_thread: list[int] = []

    async def runner() -> None:
        loop_thread.append(threading.get_ident())
        got.extend(await main())

    asyncio.run(runner())
    return got, loop_thread[0]


@pytest.mark.timeout(30)  # a wait that blocked the thread would hang the loop: fail, do not hang
def test_a_call_waiting_for_a_socket_lets_the_loop_run_another_call_on_its_thread() -> None:
    a, b = socket.socketpair()
    steps: list[Any] = []

    def reader() -> int:
        steps.append("reader waits")
        on_loop.wait_socket(a.fileno())
        steps.append(("reader reads", a.recv(16)))
        return threading.get_ident()

    def writer() -> int:
        steps.append("writer writes")
        b.send(b"x")
        return threading.get_ident()

    with a, b:
        threads, loop_thread = _on_loop(reader, writer)
    assert steps == ["reader waits", "writer writes", ("reader reads", b"x")]
    assert threads == [loop_thread, loop_thread]


def test_outside_a_call_on_the_loop_a_wait_blocks_as_before_and_nothing_is_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        threading.Timer(0.2, b.send, (b"y",)).start()
        started = time.monotonic()
        on_loop.wait_socket(a.fileno())
        assert time.monotonic() - started >= 0.15 and a.recv(4) == b"y"
    assert not on_loop.on_loop()
    on_loop.refuse_blocking("anything")  # no error outside


def test_refusal_errors_and_cancellation_reach_the_right_place() -> None:
    def refused() -> None:
        assert on_loop.on_loop()
        on_loop.refuse_blocking("a test's wait")

    with pytest.raises(on_loop.MustNotBlock, match="a test's wait would block the event loop"):
        _on_loop(refused)

    def fails_after_a_wait() -> None:
        a, b = socket.socketpair()
        with a, b:
            b.send(b"z")
            on_loop.wait_socket(a.fileno())
            raise KeyError("after the wait")

    with pytest.raises(KeyError, match="after the wait"):
        _on_loop(fails_after_a_wait)

    def waits_on_a_closed_socket() -> str:
        a, b = socket.socketpair()
        fd = a.fileno()
        a.close(), b.close()
        try:
            on_loop.wait_socket(fd)  # the loop cannot watch it: raised here, inside the call
        except OSError:
            return "raised inside"
        return "not raised"

    assert _on_loop(waits_on_a_closed_socket)[0] == ["raised inside"]

    # cancelled while it waits, the call still runs to its end (as in a thread), then the task is cancelled
    ends: list[str] = []
    a, b = socket.socketpair()

    def slow() -> None:
        on_loop.wait_socket(a.fileno())
        ends.append(a.recv(4).decode())

    async def scenario() -> None:
        task = asyncio.ensure_future(on_loop.run_on_loop(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done() and ends == []
        b.send(b"done")
        with pytest.raises(asyncio.CancelledError):
            await task

    with a, b:
        asyncio.run(asyncio.wait_for(scenario(), 20))
    assert ends == ["done"]


@pytest.mark.timeout(30)
def test_waiting_for_work_in_threads_lets_the_loop_run() -> None:
    release = threading.Event()
    pool = ThreadPoolExecutor(2)

    def waits_for_threads() -> list[int]:
        futures = [pool.submit(lambda i=i: (release.wait(10), i)[1]) for i in range(2)]
        on_loop.wait_futures(futures)
        return [f.result() for f in futures]

    def releases() -> str:
        release.set()
        return "released"

    try:
        assert _on_loop(waits_for_threads, releases)[0] == [[0, 1], "released"]
    finally:
        pool.shutdown()


@pytest.fixture
def lock_engine(database_url: str) -> Any:
    engine = make_engine(database_url, pool_size=2)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE on_loop_rows (id int PRIMARY KEY, n int)"))
        conn.execute(text("INSERT INTO on_loop_rows VALUES (1, 0)"))
    yield engine
    engine.dispose()


@pytest.mark.timeout(60)
def test_a_call_waiting_for_a_row_lock_lets_the_loop_run_the_call_that_holds_it(lock_engine: Engine) -> None:
    """Two calls on one loop want the same row. If the second's wait for the lock blocked the loop,
    the first (suspended, holding the lock) could never commit: its lock_timeout fails it."""
    lock = DriverStatement("SELECT n FROM on_loop_rows WHERE id = 1 FOR UPDATE")
    bump = DriverStatement("UPDATE on_loop_rows SET n = n + 1 WHERE id = 1 RETURNING n")
    waiting_for_a_lock = DriverStatement(  # the next read sees a fresh snapshot of the sessions
        "SELECT pg_sleep(0.02)::text AS slept, pg_stat_clear_snapshot()::text AS cleared, count(*) AS n "
        "FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    held_r, held_w = socket.socketpair()  # the first tells the second it holds the lock
    steps: list[Any] = []

    def first() -> None:
        with lock_engine.begin() as conn:
            lock.rows(conn, {})
            steps.append("first holds the lock")
            held_w.send(b"held")
            with lock_engine.connect() as watch:  # until the second's session waits for the lock
                for _ in range(500):
                    if waiting_for_a_lock.one(watch, {})["n"]:
                        break
                else:
                    raise AssertionError("the second call never waited for the lock")
            steps.append(("first commits", bump.one(conn, {}, commit=True)["n"]))

    def second() -> None:
        on_loop.wait_socket(held_r.fileno())
        with lock_engine.begin() as conn:
            steps.append("second asks")
            DriverStatement("SET LOCAL lock_timeout = '5s'").rows(conn, {})
            steps.append(("second commits", bump.one(conn, {}, commit=True)["n"]))

    with held_r, held_w:
        _on_loop(first, second)
    assert steps == ["first holds the lock", "second asks", ("first commits", 1), ("second commits", 2)]


def test_a_sqlalchemy_statement_on_the_loop_is_refused_and_its_connection_stays_usable(lock_engine: Engine) -> None:
    raws: list[Any] = []

    def core_statement() -> None:
        with lock_engine.begin() as conn:
            raws.append(conn.connection.driver_connection)
            DriverStatement("UPDATE on_loop_rows SET n = 7 WHERE id = 1").rows(conn, {})
            conn.execute(text("SELECT 1"))

    with pytest.raises(on_loop.MustNotBlock, match="a SQLAlchemy statement"):
        _on_loop(core_statement)
    with lock_engine.connect() as conn:
        assert conn.connection.driver_connection is raws[0], "the same session, not invalidated"
        assert conn.execute(text("SELECT n FROM on_loop_rows")).scalar_one() == 0, "rolled back"
