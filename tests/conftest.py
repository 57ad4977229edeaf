"""Registers the shared fixtures of tests/fixtures/ for every test module, so that test files are
about behaviour: a real Postgres and a fresh migrated database per test (fixtures/postgres.py),
the in-process coordinator over it (fixtures/coordinator.py), the real Kafka broker
(fixtures/real_kafka.py). The service processes (fixtures/servers.py), Spark
(fixtures/spark_support.py) and the deploy files (fixtures/deploy_config.py) are imported by the
tests that use them."""

from __future__ import annotations

import pytest

from fixtures.coordinator import clock, coordinator, kafka  # noqa: F401 - fixtures
from fixtures.postgres import database_url, engine, postgres_server_url, template_url  # noqa: F401 - fixtures
from fixtures.real_kafka import FIXTURES as REAL_KAFKA_FIXTURES
from fixtures.real_kafka import kafka_each_tv, kafka_faults, kafka_tv1, kafka_tv2, real_kafka  # noqa: F401 - fixtures


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How long the real broker took: Maven's jar resolution (first use on a machine) and each start."""
    from localkafka.maven import RESOLVED
    from fixtures.real_kafka import STARTS

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
