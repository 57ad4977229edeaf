"""The operator commands (`coordinator sinks|checkpoints|transactions|commit|abort|acknowledge|prune-history`)
end to end: the command in a subprocess (`python -m coordinator.cli`) against a real uvicorn
service process. And `coordinator kafka commit-transaction|abort-transaction` against the real
Kafka broker (tests/fixtures/real_kafka.py): what a read_committed consumer sees afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.kafka_producers import (
    partition_log,
    run_transactional_producer,
    settled_partition_log,
)
from fixtures.real_kafka import RealKafka
from fixtures.servers import REPO_ROOT, ServiceProcess, Winner, clean_env, scripted_http

ADMIN = "cli-admin-token-51be"


def run(*args: str, url: str | None = None, token: str | None = ADMIN, stdin: str | None = None,
        data_dir: str = "/nonexistent/coordinator-data") -> subprocess.CompletedProcess[str]:
    env = clean_env(COORDINATOR_URL=url, COORDINATOR_ADMIN_TOKEN=token, COORDINATOR_DATA_DIR=data_dir)
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120, input=stdin)


@pytest.fixture
def service(database_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    with ServiceProcess(database_url, ADMIN, tmp_path) as svc:
        yield svc


def test_operator_commands_against_a_running_service(service: ServiceProcess) -> None:
    admin = service.client(ADMIN)
    try:
        writer = admin.with_token(admin.register_sink("orders", "ord", topics=["out"])["writer_token"])
        gen = writer.start_generation("orders", "q", "r")["generation"]
        a0 = writer.begin("orders", 0, gen, partitions=1)["attempt"]
        lease0 = writer.lease("orders", 0, a0, gen, 0, task_attempt_id=1)
        writer.commit("orders", 0, a0, gen, {0: Winner.of(lease0, producer_id=11)})
        a1 = writer.begin("orders", 1, gen, partitions=1)["attempt"]
        open_lease = writer.lease("orders", 1, a1, gen, 0, task_attempt_id=2)  # its try is writing
    finally:
        admin.close()
    url = service.url

    out = run("sinks", url=url)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split()[:3] == ["name", "transactional_id_prefix", "bootstrap_servers"]
    assert row.split()[:2] == ["orders", "ord"]
    assert [s["name"] for s in json.loads(run("sinks", "--json", url=url).stdout)] == ["orders"]

    out = run("checkpoints", "orders", url=url)
    assert out.returncode == 0, out.stderr
    states = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert states == {"1": "OPEN", "0": "COMMITTED"}
    committed = json.loads(run("checkpoints", "orders", "--state", "COMMITTED", "--json", url=url).stdout)
    assert [c["batch_id"] for c in committed] == [0]

    out = run("checkpoint", "orders", "0", url=url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["batch 0: COMMITTED (attempt 1 decided); 10 records, 1000 bytes", "leases: 1 COMMITTED"]
    assert lines[3].split()[:3] == ["number", "state", "generation"] and lines[4].split()[:2] == ["1", "COMMITTED"]
    out = run("checkpoint", "orders", "1", "--leases", url=url)
    assert out.stdout.splitlines()[0] == "batch 1: OPEN; nothing decided yet", out.stderr
    lease_row = out.stdout.splitlines()[-1].split()  # no producer or records yet: they come with the commit
    assert lease_row == [str(open_lease["lease_id"]), str(a1), "0", "2", open_lease["transactional_id"], "LEASED"]
    listed = json.loads(run("checkpoint", "orders", "1", "--lease-state", "COMMITTED", "--json",
                            url=url).stdout)
    assert listed["leases"] == [] and listed["lease_counts"] == {"LEASED": 1}
    assert run("checkpoint", "orders", "9", url=url).stderr.startswith("coordinator checkpoint: unknown_checkpoint")

    out = run("transactions", "orders", url=url)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split() == ["lease_id", "partition", "transactional_id", "state", "producer_id", "producer_epoch",
                              "records", "age_s", "timeout_s", "age_pct"]
    cells = row.split()  # producer_id, producer_epoch and records are empty until the commit
    assert cells[:4] == [str(open_lease["lease_id"]), "0", open_lease["transactional_id"], "LEASED"]
    assert cells[5] == "60.0" and 0 <= float(cells[4]) < 60  # age vs the 60 s timeout

    out = run("commit", "orders", "0", url=url)  # finished already: answered from the record
    assert out.returncode == 0 and out.stdout.startswith("batch 0: COMMITTED by attempt 1; 1 partition(s) committed")
    out = run("commit", "orders", "1", url=url)  # nothing decided: the API's reason and message, exit 1
    assert out.returncode == 1 and out.stdout == ""
    assert "coordinator commit: not_committing: batch 1 has no decided commit to resume" in out.stderr

    out = run("abort", "orders", "1", str(a1), "--reason", "executor stuck", url=url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"batch 1 attempt {a1}: ABORTED; aborted ['{open_lease['transactional_id']}']")
    assert run("transactions", "orders", url=url).stdout.strip() == "(none)"
    admin = service.client(ADMIN)
    try:
        events = admin.request("GET", "/v1/sinks/orders/events?batch_id=1")
    finally:
        admin.close()
    assert [e["detail"]["reason"] for e in events if e["kind"] == "attempt_aborted"] == ["executor stuck"]

    out = run("acknowledge", "orders", "--reason", "checked", "--operator", "alice", url=url)
    assert out.returncode == 0 and "was not halted: nothing to acknowledge" in out.stdout

    out = run("checkpoints", "nosuch", url=url)
    assert out.returncode == 1 and out.stderr == "coordinator checkpoints: unknown_sink: no sink named 'nosuch'\n"
    out = run("sinks", url=url, token="wrong-token")
    assert out.returncode == 1 and "coordinator sinks: forbidden: this action needs the admin token" in out.stderr
    out = run("sinks", url=url, token=None)
    assert out.returncode == 1 and "COORDINATOR_ADMIN_TOKEN" in out.stderr

    admin = service.client(ADMIN)  # a batch wider than one page of leases
    try:
        writer = admin.with_token(admin.request("POST", "/v1/sinks/orders/writer-token")["writer_token"])
        writer.request("POST", "/v1/sinks/orders/checkpoints/2/begin", {"generation": gen, "partitions": 1001})
    finally:
        admin.close()
    wide = json.loads(run("checkpoint", "orders", "2", "--leases", "--json", url=url).stdout)
    assert [x["partition"] for x in wide["leases"]] == list(range(1001)) and wide["lease_counts"] == {"PRELEASED": 1001}


def test_an_answer_that_is_not_the_coordinators_is_one_clear_line() -> None:
    """--url pointing at something else (a login page, a redirecting proxy): one line naming the URL
    and what to check, exit 1, no traceback. A scripted HTTP server plays the wrong service."""
    login_page = (200, "<html><body>Please log in</body></html>", {"Content-Type": "text/html"})
    redirect = (302, "", {"Location": "https://sso.example/login", "Content-Type": "text/html"})
    for answer, what in [(login_page, "answered 200 with text/html, not JSON"),
                         (redirect, "answered 302 redirecting to https://sso.example/login")]:
        with scripted_http() as (url, script):
            script.answers = [answer]
            out = run("checkpoints", "orders", url=url)
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"coordinator checkpoints: not_coordinator: GET {url}/v1/sinks/orders/checkpoints")
        assert what in out.stderr and "check that --url (or COORDINATOR_URL) points at the coordinator" in out.stderr


def test_url_and_token_go_before_or_after_the_subcommand(service: ServiceProcess) -> None:
    admin = service.client(ADMIN)
    try:
        admin.register_sink("orders", "ord", topics=["out"], check_broker=False)
    finally:
        admin.close()
    for argv in (["--url", service.url, "--token", ADMIN, "sinks"],
                 ["sinks", "--url", service.url, "--token", ADMIN],
                 ["--url", service.url, "sinks", "--token", ADMIN, "--json"],
                 ["--json", "--url", service.url, "--token", ADMIN, "sinks"]):
        out = run(*argv, token=None)
        assert out.returncode == 0, (argv, out.stderr)
        assert "orders" in out.stdout, argv
        assert out.stdout.lstrip().startswith("[") == ("--json" in argv), (argv, out.stdout)
    # a wrong token given first is not replaced by the subcommand's defaults
    out = run("--token", "wrong", "sinks", url=service.url, token=None)
    assert out.returncode == 1 and "coordinator sinks:" in out.stderr


def test_the_embedded_defaults_token_is_read_for_a_local_coordinator_only(service: ServiceProcess,
                                                                          tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "admin-token").write_text(ADMIN + "\n")
    out = run("sinks", url=service.url, token=None, data_dir=str(data_dir))
    assert out.returncode == 0 and out.stdout.strip() == "(none)", out.stderr
    # never sent to another machine: a non-loopback URL without a token is refused before any request
    out = run("sinks", url="http://192.0.2.1:8000", token=None, data_dir=str(data_dir))
    assert out.returncode == 1 and "no_token" in out.stderr and "admin-token" in out.stderr
    out = run("sinks", url=service.url, token=None, data_dir=str(tmp_path / "empty"))
    assert out.returncode == 1 and "no_token" in out.stderr


def test_serve_with_the_embedded_default_is_quiet_and_the_cli_finds_its_token_and_database(tmp_path: Path) -> None:
    """`coordinator serve` with no database URL: initdb's output goes to data_dir/postgres.log, the
    token line says 'generated' only the first time, and `coordinator sinks` / `coordinator doctor`
    find the token and the database without being told."""
    from fixtures.servers import free_port, stop_process

    data_dir = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = clean_env(COORDINATOR_DATA_DIR=str(data_dir), COORDINATOR_PORT=str(port), COORDINATOR_RECOVERY_ENABLED="false")
    logs = []
    for start in range(2):
        log_path = tmp_path / f"serve-{start}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve"], cwd=tmp_path, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            from fixtures.servers import wait_for_http

            wait_for_http(url + "/healthz", proc, log_path)
            if start == 0:
                out = run("sinks", url=url, token=None, data_dir=str(data_dir))
                assert out.returncode == 0 and out.stdout.strip() == "(none)", out.stderr
                out = subprocess.run([sys.executable, "-m", "coordinator.cli", "doctor"], cwd=tmp_path, env=env,
                                     capture_output=True, text=True, timeout=120)
                assert "checking the embedded Postgres in" in out.stdout, out.stdout + out.stderr
                assert "the schema is at the migrations' head" in out.stdout, out.stdout
                assert out.returncode == 0, out.stdout + out.stderr
        finally:
            assert stop_process(proc) in (0, 143)
        logs.append(log_path.read_text())
    assert "admin token generated in" in logs[0] and "admin token generated" not in logs[1]
    assert "admin token read from" in logs[1]
    for text in logs:
        assert "initdb" not in text and "The files belonging to this database system" not in text, text
        assert "setup plugin alembic" not in text
    assert "The files belonging to this database system" in (data_dir / "postgres.log").read_text()


def test_defaults_agree_with_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real control plane is the default; the restart budget leaves a 60 s timeout room for
    ordinary batches, so the batch-duration warning fires only for a slow one."""
    from datetime import datetime, timedelta, timezone

    from coordinator.protocol import rules
    from coordinator.service.results import Limits, SinkSpec
    from coordinator.settings import Settings

    for key in [k for k in __import__("os").environ if k.startswith("COORDINATOR_")]:
        monkeypatch.delenv(key)
    settings = Settings()
    assert settings.kafka_control_plane == "kafka"
    assert settings.restart_budget_ms == Limits().restart_budget_ms
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    timeout = SinkSpec("s", "p", "b", ["t"]).transaction_timeout_ms
    assert rules.batch_duration_warning(t0, t0 + timedelta(seconds=2), settings.restart_budget_ms, timeout) is None
    assert rules.batch_duration_warning(t0, t0 + timedelta(seconds=45), settings.restart_budget_ms, timeout)


# --- kafka commit-transaction / abort-transaction ---------------------------------------------------


def test_kafka_commit_transaction_by_producer_id_and_epoch(real_kafka: RealKafka) -> None:
    topic = real_kafka.create_topic(1)
    stats = run_transactional_producer(real_kafka.bootstrap, f"lost-job-{uuid.uuid4().hex[:8]}", topic, records=4)
    assert partition_log(real_kafka.bootstrap, topic, 0).has_open_transaction
    base = ["kafka", "commit-transaction", "--bootstrap-servers", real_kafka.bootstrap,
            "--transactional-id", stats.transactional_id, "--producer-id", str(stats.producer_id),
            "--epoch", str(stats.producer_epoch)]

    unforced = run(*base, "--yes")  # a commit outside the coordinator's decision needs --force, and says why
    assert unforced.returncode == 2 and "refused without --force" in unforced.stderr
    assert "duplicates" in unforced.stderr and "coordinator commit SINK BATCH" in unforced.stderr
    refused = run(*base, "--force", stdin="")  # no --yes and no terminal: nothing is done
    assert refused.returncode == 2 and "pass --yes" in refused.stderr
    assert partition_log(real_kafka.bootstrap, topic, 0).markers(stats.producer_id) == []

    out = run(*base, "--force", "--yes")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"committed: transaction '{stats.transactional_id}'")
    after = settled_partition_log(real_kafka.bootstrap, topic, 0)
    assert after.markers(stats.producer_id) == ["commit"] and not after.has_open_transaction
    assert [m.value() for m in real_kafka.read_committed(topic)] == [b"record-%d" % i for i in range(4)]


def test_kafka_abort_transaction_by_transactional_id(real_kafka: RealKafka) -> None:
    topic = real_kafka.create_topic(1)
    stats = run_transactional_producer(real_kafka.bootstrap, f"lost-job-{uuid.uuid4().hex[:8]}", topic)
    out = run("kafka", "abort-transaction", "--bootstrap-servers", real_kafka.bootstrap,
              "--transactional-id", stats.transactional_id, "--yes")
    assert out.returncode == 0, out.stderr
    after = settled_partition_log(real_kafka.bootstrap, topic, 0)
    assert after.markers(stats.producer_id) == ["abort"] and not after.has_open_transaction
    assert real_kafka.read_committed(topic) == []


def test_kafka_commit_with_a_wrong_epoch_is_refused(real_kafka: RealKafka) -> None:
    topic = real_kafka.create_topic(1)
    stats = run_transactional_producer(real_kafka.bootstrap, f"lost-job-{uuid.uuid4().hex[:8]}", topic)
    out = run("kafka", "commit-transaction", "--bootstrap-servers", real_kafka.bootstrap, "--transactional-id",
              stats.transactional_id, "--producer-id", "-1", "--epoch", "0", "--force", "--yes")
    # refused before anything is sent: no producer has id -1 (the API's ProducerId bounds the argument)
    assert out.returncode == 2 and "argument --producer-id: Input should be greater than or equal to 0" in out.stderr
    stale = run("kafka", "commit-transaction", "--bootstrap-servers", real_kafka.bootstrap, "--transactional-id",
                stats.transactional_id, "--producer-id", str(stats.producer_id), "--epoch",
                str(stats.producer_epoch + 1), "--force", "--yes")
    assert stale.returncode == 1 and "producer_fenced (refused for good)" in stale.stderr, stale.stderr
    assert partition_log(real_kafka.bootstrap, topic, 0).markers(stats.producer_id) == []


def test_prune_history_deletes_old_batches_history_chunk_by_chunk(service: ServiceProcess, database_url: str) -> None:
    from sqlalchemy import create_engine, text

    admin = service.client(ADMIN)
    try:
        writer = admin.with_token(admin.register_sink("orders", "ord", topics=["out"])["writer_token"])
        gen = writer.start_generation("orders", "q", "r")["generation"]
        for batch in range(3):
            attempt = writer.begin("orders", batch, gen, partitions=1)["attempt"]
            lease = writer.lease("orders", batch, attempt, gen, 0, task_attempt_id=1)
            writer.commit("orders", batch, attempt, gen, {0: Winner.of(lease, producer_id=11 + batch)})
    finally:
        admin.close()
    engine = create_engine(database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:  # the batches were committed three hours ago
        conn.execute(text("UPDATE checkpoints SET committed_at = committed_at - interval '3 hours'"))
    engine.dispose()
    url = service.url

    out = run("prune-history", "--older-than", "2h", "--dry-run", url=url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 committed batch(es) of all sinks committed before ")
    assert out.stdout.rstrip().endswith("would lose their history (orders: 2)")  # batch 2, the newest, stays

    out = run("prune-history", "--older-than", "2h", "--batch-size", "1", url=url)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == ["pruned 1 of ~2 batch(es)", "pruned 2 of ~2 batch(es)"]
    assert "pruned the history of 2 committed batch(es) of all sinks" in out.stdout
    assert ": 2 attempt(s), 2 lease(s), 2 event(s); their checkpoint rows stay" in out.stdout
    listed = json.loads(run("checkpoints", "orders", "--json", url=url).stdout)
    assert [(c["batch_id"], c["state"], c["history_pruned_at"] is not None) for c in listed] == [
        (2, "COMMITTED", False), (1, "COMMITTED", True), (0, "COMMITTED", True)]
    out = run("commit", "orders", "0", url=url)
    assert out.returncode == 1 and "coordinator commit: history_pruned: batch 0 committed at" in out.stderr
    out = run("checkpoint", "orders", "0", url=url)
    assert out.stdout.startswith("batch 0: COMMITTED (attempt 1 decided); history pruned at "), out.stderr
    assert "leases: none" in out.stdout

    again = run("prune-history", "--older-than", "2h", "--sink", "orders", url=url)
    assert again.returncode == 0 and again.stdout.startswith("0 committed batch(es) of sink orders"), again.stderr
    unknown = run("prune-history", "--older-than", "2h", "--sink", "nosuch", url=url)
    assert unknown.returncode == 1 and "unknown_sink: no sink named 'nosuch'" in unknown.stderr
    young = run("prune-history", "--older-than", "30m", url=url)
    assert young.returncode == 1, young.stderr
    assert "coordinator prune-history: invalid_prune: history younger than 1:00:00 is kept" in young.stderr
    bad = run("prune-history", "--older-than", "soon", url=url)
    assert bad.returncode == 2 and "not a duration like 30d" in bad.stderr
    bad = run("prune-history", "--older-than", "2h", "--batch-size", "0", url=url)
    assert bad.returncode == 2 and "'0' is not a whole number of batches from 1 to 5000" in bad.stderr
