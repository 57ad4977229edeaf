"""`coordinator doctor` against a reachable broker, an unreachable one, a timeout misconfiguration,
a database behind its migrations and an unreachable database -- each with its verdict and exit code.

The broker is a real Apache Kafka (tests/fixtures/real_kafka.py): the doctor reads its
transaction.max.timeout.ms through DescribeConfigs and lists transactional ids with KIP-664
ListTransactions.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from fixtures.kafka_producers import run_transactional_producer
from fixtures.real_kafka import RealKafka
from fixtures.servers import REPO_ROOT, clean_env

from coordinator import cli
from coordinator.service import Coordinator, SinkSpec
from localkafka import free_port


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[tuple[str, str], dict[str, Any]]]:
    code = cli.main(["doctor", "--json", "--kafka-timeout-ms", "2000", *args])
    findings = json.loads(capsys.readouterr().out)
    by_key = {(f["scope"], f["check"]): f for f in findings}
    assert len(by_key) == len(findings), findings
    return code, by_key


def verdicts(found: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {k: f["verdict"] for k, f in found.items()}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("COORDINATOR_DATABASE_URL", "COORDINATOR_RESTART_BUDGET_MS", "COORDINATOR_BROKER_MAX_TRANSACTION_TIMEOUT_MS"):
        monkeypatch.delenv(key, raising=False)


def prefix() -> str:
    return f"pfx{uuid.uuid4().hex[:8]}"


def test_reachable_broker_and_current_database(real_kafka: RealKafka, database_url: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, found = doctor(capsys, "--database-url", database_url, "--bootstrap-servers", real_kafka.bootstrap,
                         "--prefix", prefix(), "--transaction-timeout-ms", "120000", "--sink", "orders")
    assert verdicts(found) == {
        ("database", "database"): "ok",
        ("database", "migrations"): "ok",
        ("database", "history"): "ok",
        ("sink orders", "coordinator_timeouts"): "ok",
        ("sink orders", "commit_reach"): "ok",
        ("sink orders", "bootstrap"): "ok",
        ("sink orders", "advertised_listeners"): "ok",
        ("sink orders", "transactions_supported"): "ok",
        ("sink orders", "transaction_timeout"): "ok",
        ("sink orders", "prefix_unused"): "ok",
        ("sink orders", "prefix_clash"): "ok",
    }
    assert code == 0
    assert found[("sink orders", "transaction_timeout")]["detail"] == (
        "the sink's transaction.timeout.ms 120000 is within the broker's transaction.max.timeout.ms 900000")
    assert found[("database", "migrations")]["fix"] is None


def test_unreachable_broker_fails_with_its_fix(capsys: pytest.CaptureFixture[str]) -> None:
    closed = free_port()
    code, found = doctor(capsys, "--bootstrap-servers", f"127.0.0.1:{closed}", "--prefix", prefix())
    bootstrap = found[("sink unregistered", "bootstrap")]
    assert bootstrap["verdict"] == "fail" and code == 1
    assert f"cannot reach any bootstrap server 127.0.0.1:{closed}" in bootstrap["detail"]
    assert "kafka.bootstrap.servers" in bootstrap["fix"]
    assert found[("database", "database")]["verdict"] == "warn"  # no database given: said, not failed


def test_unreachable_broker_through_the_console_command() -> None:
    """The same verdict from the installed entry point, as an operator runs it (plain text)."""
    closed = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "doctor", "--bootstrap-servers", f"127.0.0.1:{closed}",
         "--prefix", "p", "--kafka-timeout-ms", "2000"],
        cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert f"[fail] sink unregistered / bootstrap: cannot reach any bootstrap server 127.0.0.1:{closed}" in out.stdout
    assert "       fix: check kafka.bootstrap.servers" in out.stdout
    assert out.stdout.strip().splitlines()[-1].endswith("1 fail")


def test_sink_timeout_above_the_brokers_maximum(real_kafka: RealKafka, capsys: pytest.CaptureFixture[str]) -> None:
    """transaction.max.timeout.ms as the broker reports it through DescribeConfigs (Kafka's
    default, 900000 ms)."""
    code, found = doctor(capsys, "--bootstrap-servers", real_kafka.bootstrap, "--prefix", prefix(),
                         "--transaction-timeout-ms", "1000000")
    timeout = found[("sink unregistered", "transaction_timeout")]
    assert code == 1 and timeout["verdict"] == "fail"
    assert "1000000 exceeds the broker's transaction.max.timeout.ms 900000" in timeout["detail"]
    assert "lower the sink's transaction_timeout_ms to at most 900000" in timeout["fix"]
    assert found[("sink unregistered", "bootstrap")]["verdict"] == "ok"

    code, found = doctor(capsys, "--bootstrap-servers", real_kafka.bootstrap, "--prefix", prefix(),
                         "--transaction-timeout-ms", "20000")
    assert found[("sink unregistered", "transaction_timeout")]["verdict"] == "ok"


def test_prefix_used_by_a_producer_on_the_broker(real_kafka: RealKafka, capsys: pytest.CaptureFixture[str]) -> None:
    p = prefix()
    topic = real_kafka.create_topic(1)
    stats = run_transactional_producer(real_kafka.bootstrap, f"{p}-legacy", topic, records=1)
    code, found = doctor(capsys, "--bootstrap-servers", real_kafka.bootstrap, "--prefix", p)
    unused = found[("sink unregistered", "prefix_unused")]
    assert code == 1 and unused["verdict"] == "fail"
    assert f"{p}-legacy (producer id {stats.producer_id}, Ongoing)" in unused["detail"]


def test_registered_sinks_and_prefix_clash(real_kafka: RealKafka, coordinator: Coordinator, database_url: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    p = prefix()
    coordinator.register_sink(SinkSpec("orders", p, real_kafka.bootstrap, ["out"], transaction_timeout_ms=120_000,
                                       commit_margin_ms=30_000), "admin")  # above the default commit reach
    code, found = doctor(capsys, "--database-url", database_url)  # every registered sink
    assert found[("sink orders", "bootstrap")]["verdict"] == "ok"
    assert found[("sink orders", "prefix_clash")]["verdict"] == "ok"
    assert code == 0

    # a sink about to be registered whose prefix extends an existing one's
    code, found = doctor(capsys, "--database-url", database_url, "--bootstrap-servers", real_kafka.bootstrap,
                         "--prefix", p + "x", "--transaction-timeout-ms", "120000", "--sink", "views")
    clash = found[("sink views", "prefix_clash")]
    assert code == 1 and clash["verdict"] == "fail"
    assert f"overlaps the prefix of orders ('{p}')" in clash["detail"]
    assert "neither equal to nor a prefix" in clash["fix"]


def test_timeout_above_the_coordinators_limit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORDINATOR_BROKER_MAX_TRANSACTION_TIMEOUT_MS", "300000")
    closed = free_port()
    code, found = doctor(capsys, "--bootstrap-servers", f"127.0.0.1:{closed}", "--prefix", prefix(),
                         "--transaction-timeout-ms", "600000")
    limit = found[("sink unregistered", "coordinator_timeouts")]
    assert code == 1 and limit["verdict"] == "fail"
    assert "exceeds the coordinator's limit COORDINATOR_BROKER_MAX_TRANSACTION_TIMEOUT_MS=300000" in limit["detail"]


def test_database_migrated_by_a_newer_version_and_unreachable(database_url: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """(One baseline migration: no schema is behind the head but an empty one, test_database_without_schema.)"""
    engine = create_engine(database_url)
    with engine.begin() as conn:  # as a later version of the coordinator would have left it
        conn.execute(text("UPDATE alembic_version SET version_num = '0042_from_a_newer_version'"))
    engine.dispose()
    code, found = doctor(capsys, "--database-url", database_url)
    migrations = found[("database", "migrations")]
    assert code == 1 and found[("database", "database")]["verdict"] == "ok"
    assert migrations["verdict"] == "fail", migrations
    assert "revision 0042_from_a_newer_version, which this version of the coordinator does not know" in \
        migrations["detail"]
    assert "migrated by a newer version" in migrations["detail"] and "coordinator version" in migrations["fix"]

    closed = free_port()
    code, found = doctor(capsys, "--database-url", f"postgresql://nobody:secret@127.0.0.1:{closed}/coordinator")
    db = found[("database", "database")]
    assert code == 1 and db["verdict"] == "fail" and "cannot reach the database" in db["detail"]
    assert "secret" not in db["detail"]  # the password is never printed
    assert ("database", "migrations") not in found


def test_database_without_schema(postgres_server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sqlalchemy.engine import make_url

    name = f"empty_{uuid.uuid4().hex[:8]}"
    plain = postgres_server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = make_url(plain).set(database=name).render_as_string(hide_password=False)
        code, found = doctor(capsys, "--database-url", url)
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert code == 1 and "no coordinator schema" in found[("database", "migrations")]["detail"]


def test_a_commit_margin_registration_would_refuse_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """The doctor applies the rules registration applies (rules.validate_timeouts)."""
    code, found = doctor(capsys, "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--prefix", prefix(),
                         "--transaction-timeout-ms", "60000", "--commit-margin-ms", "60000")
    timeouts = found[("sink unregistered", "coordinator_timeouts")]
    assert code == 1 and timeouts["verdict"] == "fail", timeouts
    assert "must be below transaction_timeout_ms=60000" in timeouts["detail"], timeouts
    assert "registration would be refused" in timeouts["detail"]


def test_a_negative_commit_margin_is_refused_before_any_check(capsys: pytest.CaptureFixture[str]) -> None:
    """The API's input types bound the doctor's arguments too: a negative margin is a usage error."""
    with pytest.raises(SystemExit) as exc:
        doctor(capsys, "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--prefix", prefix(),
               "--commit-margin-ms", "-1")
    assert exc.value.code == 2 and "--commit-margin-ms" in capsys.readouterr().err


def test_a_sink_asked_for_without_a_database_fails_rather_than_checking_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, found = doctor(capsys, "--sink", "orders")
    assert found[("database", "database")]["verdict"] == "warn"
    registered = found[("sink orders", "registered")]
    assert code == 1 and registered["verdict"] == "fail" and "--database-url" in registered["fix"]


def test_a_commit_margin_below_the_commit_reach_fails_and_names_the_numbers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15 item 6, issue 50 §1: the margin must exceed how late a decided commit may still reach
    Kafka (the retry window counted from the decision, then a request timeout)."""
    monkeypatch.setenv("COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS", "4000")
    monkeypatch.setenv("COORDINATOR_KAFKA_RETRY_BUDGET_MS", "8000")
    code, found = doctor(capsys, "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--prefix", prefix(),
                         "--transaction-timeout-ms", "60000", "--commit-margin-ms", "6000")
    reach = found[("sink unregistered", "commit_reach")]
    assert code == 1 and reach["verdict"] == "fail", reach
    assert "commit_margin_ms=6000" in reach["detail"]
    monkeypatch.setenv("COORDINATOR_RECOVERY_LEADER_TTL_MS", "9000")
    monkeypatch.setenv("COORDINATOR_RECOVERY_INTERVAL_MS", "3000")
    code, found = doctor(capsys, "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--prefix", prefix(),
                         "--transaction-timeout-ms", "60000", "--commit-margin-ms", "6000")
    reach = found[("sink unregistered", "commit_reach")]
    # the reach from these settings (configuration.CommitReach), each named with its figure
    assert "= 27000 ms" in reach["detail"] and "at least 30000" in reach["fix"]
    for named in ("budget 8000", "interval 3000", "TTL 9000", "timeout (4000)"):
        assert named in reach["detail"], (named, reach["detail"])

    code, found = doctor(capsys, "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--prefix", prefix(),
                         "--transaction-timeout-ms", "60000")  # the default margin clears it
    assert found[("sink unregistered", "commit_reach")]["verdict"] == "ok"


def test_the_history_kept_against_the_retention(coordinator: Coordinator, database_url: str,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.cli import doctor as doctor_module
    from coordinator.protocol.model import PartitionResult, PrecommitRecord

    coordinator.register_sink(SinkSpec("orders", prefix(), "127.0.0.1:9", ["out"]), "admin")
    gen, _ = coordinator.start_generation("orders", "q", "r", "admin")
    for b in range(3):
        coordinator.begin_checkpoint("orders", b, gen, "admin", partitions=2)
        claimed = [coordinator.lease("orders", b, 1, gen, p, 10 * b + p).lease for p in range(2)]
        coordinator.commit("orders", b, 1, gen, [PartitionResult(x.partition, x.id, PrecommitRecord(
            10 * b + x.partition, 7, 0, 5, 50, 1, [["out", 0, b]])) for x in claimed], "admin")
    _, found = doctor(capsys, "--database-url", database_url, "--sink", "orders")
    history = found[("database", "history")]
    assert history["verdict"] == "ok" and "for 3 committed batch(es), the oldest committed " in history["detail"]
    assert "no retention is set" in history["detail"]
    monkeypatch.setattr(doctor_module, "HISTORY_WARN_BYTES", 0)  # as if the history had grown past 1 GiB
    _, found = doctor(capsys, "--database-url", database_url, "--sink", "orders")
    assert found[("database", "history")]["verdict"] == "warn"
    assert "COORDINATOR_HISTORY_RETENTION_HOURS" in found[("database", "history")]["fix"]
    monkeypatch.setenv("COORDINATOR_HISTORY_RETENTION_HOURS", "720")
    _, found = doctor(capsys, "--database-url", database_url, "--sink", "orders")
    assert found[("database", "history")]["verdict"] == "ok"
    assert "the recovery leader prunes batches older than 720 h" in found[("database", "history")]["detail"]
