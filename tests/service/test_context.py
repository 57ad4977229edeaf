"""ServiceContext, the service's one way to the database: pooled connections are not pinged before
use, so a connection the database dropped (a restart, a failover, an idle timeout) must be
replaced without any caller seeing it: a transaction, a read, the readiness check and the
scrape-time gauges all answer as before."""

from __future__ import annotations

import psycopg
import pytest
from fixtures.protocol_calls import NAME, start
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from coordinator.protocol.rules import BeginAction
from coordinator.service import Coordinator
from coordinator.service.metrics import DatabaseCollector
from coordinator.store import sinks
from coordinator.store.db import schema_is_current


def drop_every_connection(database_url: str, engine: Engine) -> int:
    """What a database restart does to the pool: every session of the engine's database ended."""
    plain = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(plain, autocommit=True) as admin:
        (ended,) = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchone()
    return int(ended)


def test_a_dropped_connection_is_replaced_without_the_caller_seeing_it(coordinator: Coordinator, database_url: str):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, "test")
    # the pool holds open connections; the database ends them all
    with c.engine.connect(), c.engine.connect():
        pass
    assert c.engine.pool.checkedin() >= 2
    assert drop_every_connection(database_url, c.engine) >= 2
    # a protocol call (one transaction) answers as if nothing happened
    assert c.begin_checkpoint(NAME, 1, gen, "test").action is BeginAction.NEW_ATTEMPT

    assert drop_every_connection(database_url, c.engine) >= 1
    assert c.ctx.read(lambda conn: sinks.sink_by_name(conn, NAME)).name == NAME  # a read
    assert drop_every_connection(database_url, c.engine) >= 1
    assert c.ctx.read(schema_is_current)  # what /readyz asks
    assert drop_every_connection(database_url, c.engine) >= 1
    families = {m.name: m for m in DatabaseCollector(c.ctx.read, ttl_s=0).collect()}
    assert [s.value for s in families["coordinator_database_up"].samples] == [1]


def test_without_the_retry_a_dropped_connection_fails_the_call(coordinator: Coordinator, database_url: str):
    """The check above could fail: the same drop, read on a bare connection of the pool, fails."""
    c = coordinator
    with c.engine.connect():
        pass
    drop_every_connection(database_url, c.engine)
    with pytest.raises(OperationalError), c.engine.connect() as conn:
        sinks.sink_by_name(conn, NAME)
