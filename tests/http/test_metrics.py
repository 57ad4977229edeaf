"""/metrics after real protocol traffic through a real uvicorn service process, and the Grafana
dashboard (deploy/grafana/coordinator-dashboard.json) checked against the names the service
really exports, so the dashboard cannot drift from the code.

The service runs with the record-only Kafka control plane: these tests are about what the
coordinator counts, not about Kafka. Its recovery loop runs once at start-up and then waits
10 s, so every figure below comes from the test's own calls.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from coordinator.http.api import create_app
from coordinator.kafka.control_plane import PartitionStability, RecordingControlPlane
from coordinator.protocol.states import MAY_HOLD_TRANSACTION
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.servers import REPO_ROOT, ProtocolClient, ServiceProcess, Winner

ADMIN = "metrics-admin-token-9c1d"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "coordinator-dashboard.json"
BEGIN_ROUTE = "/v1/sinks/{name}/checkpoints/{batch_id}/begin"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition: (name, sorted labels) -> value."""
    resp = httpx.get(url + "/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def exported_names(url: str) -> set[str]:
    """The series names the service exposes, including families with no sample yet (a labelled
    counter appears only with its HELP/TYPE lines until something is counted)."""
    names = set()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "summary": ["_count", "_sum"]}
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
        names.update(s.name for s in family.samples)
    return names


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def service(database_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(database_url, ADMIN, tmp_path, env={
        # a long interval, and Kafka timeouts short enough that the commit reach (33 s with these)
        # leaves a 60 s sink room for its batches (configuration.CommitReach: registration refuses
        # sinks otherwise)
        "COORDINATOR_RECOVERY_INTERVAL_MS": "10000", "COORDINATOR_RECOVERY_LEADER_TTL_MS": "11000",
        "COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS": "1000", "COORDINATOR_KAFKA_RETRY_BUDGET_MS": "1000",
    })
    with svc:
        yield svc


def traffic(admin: ProtocolClient) -> None:
    """Batch 0 committed (two partitions), batch 1's attempt aborted by its driver, one stale driver
    fenced, batch 2 left open with one leased transaction."""
    writer = admin.with_token(admin.register_sink("orders", "ord")["writer_token"])
    gen = writer.start_generation("orders", "query-1", "run-1")["generation"]
    a0 = writer.begin("orders", 0, gen, partitions=2)["attempt"]
    winners: dict[int, Winner | None] = {}
    for partition in (0, 1):
        lease = writer.lease("orders", 0, a0, gen, partition, task_attempt_id=partition)
        winners[partition] = Winner.of(lease, producer_id=100 + partition)
    assert writer.commit("orders", 0, a0, gen, winners)["state"] == "COMMITTED"

    a1 = writer.begin("orders", 1, gen)["attempt"]
    lease = writer.lease("orders", 1, a1, gen, 0, task_attempt_id=10)
    assert writer.abort("orders", 1, a1, gen, "driver gave up")["aborted"] == [lease["transactional_id"]]

    gen2 = writer.start_generation("orders", "query-1", "run-2")["generation"]
    stale = writer.begin("orders", 2, gen, expect=409)  # the old driver is fenced
    assert stale["error"]["reason"] == "stale_generation"
    a2 = writer.begin("orders", 2, gen2)["attempt"]
    writer.lease("orders", 2, a2, gen2, 0, task_attempt_id=20)  # open: not pre-committed


def traffic_through(service: ServiceProcess) -> None:
    admin = service.client(ADMIN)
    try:
        traffic(admin)
    finally:
        admin.close()


def test_metrics_after_protocol_traffic(service: ServiceProcess) -> None:
    traffic_through(service)
    m = scrape(service.url)

    # checkpoints by outcome
    assert value(m, "coordinator_checkpoint_outcomes_total", sink="orders", outcome="committed") == 1
    assert value(m, "coordinator_checkpoint_outcomes_total", sink="orders", outcome="aborted") == 1
    assert value(m, "coordinator_checkpoint_outcomes_total", sink="orders", outcome="lost") == 0
    # one decided commit finished; one transaction aborted on Kafka (batch 1's lease)
    assert value(m, "coordinator_commit_duration_seconds_count", sink="orders") == 1
    assert value(m, "coordinator_commit_duration_seconds_bucket", sink="orders", le="+Inf") == 1
    assert value(m, "coordinator_abort_duration_seconds_count", sink="orders") == 1
    assert 0 < value(m, "coordinator_commit_duration_seconds_sum", sink="orders") < 60
    # the stale driver's begin, by its 409 reason
    assert value(m, "coordinator_fenced_requests_total", reason="stale_generation") == 1
    assert [k for k in m if k[0] == "coordinator_fenced_requests_total"] == [
        ("coordinator_fenced_requests_total", (("reason", "stale_generation"),))]
    # state from the database: batch 2's leased transaction is open, and its checkpoint; every
    # unresolved lease state has its series (zeros included), and no other
    open_series = {dict(k[1])["state"]: v for k, v in m.items() if k[0] == "coordinator_open_transactions"}
    assert open_series == {state.value: (1 if state.value == "LEASED" else 0) for state in MAY_HOLD_TRANSACTION}
    # a halt is read from the database by every replica (this one leads the recovery loop or not)
    assert ("coordinator_sink_halted", (("sink", "orders"),)) in m and value(m, "coordinator_sink_halted", sink="orders") == 0
    # batch 1 (its attempt aborted, waiting for Spark's replay) and batch 2 are open; batch 0 committed
    assert value(m, "coordinator_checkpoints", sink="orders", state="OPEN") == 2
    assert value(m, "coordinator_checkpoints", sink="orders", state="COMMITTING") == 0
    assert 0 < value(m, "coordinator_oldest_open_transaction_age_seconds", sink="orders") < 600
    assert value(m, "coordinator_database_up") == 1
    # HTTP latency by route template: three begins answered 200, one 409; never the raw path
    begins = {dict(k[1])["status"]: v for k, v in m.items()
              if k[0] == "coordinator_http_request_duration_seconds_count" and dict(k[1])["route"] == BEGIN_ROUTE}
    assert begins == {"200": 3, "409": 1}
    routes = {dict(k[1])["route"] for k in m if k[0] == "coordinator_http_request_duration_seconds_count"}
    assert not any("orders" in r for r in routes), routes

    # a second scrape sees the same database state (and a resolved transaction leaves the gauge)
    again = scrape(service.url)
    assert value(again, "coordinator_open_transactions", sink="orders", state="LEASED") == 1


def test_open_transaction_gauges_follow_the_database(service: ServiceProcess) -> None:
    """The gauges come from the database at scrape time: the same on every replica, and they
    drop when the transaction is resolved (an operator abort through the API)."""
    admin = service.client(ADMIN)
    try:
        writer = admin.with_token(admin.register_sink("views", "vw")["writer_token"])
        gen = writer.start_generation("views", "q", "r")["generation"]
        attempt = writer.begin("views", 0, gen, partitions=2)["attempt"]
        writer.lease("views", 0, attempt, gen, 0, task_attempt_id=1)  # claims partition 0's pre-lease
        time.sleep(2.1)  # past the collector's cache
        before = scrape(service.url)
        assert value(before, "coordinator_open_transactions", sink="views", state="LEASED") == 1
        # partition 1's pre-lease holds its id, but no transaction: no try ever had it
        assert ("coordinator_open_transactions", (("sink", "views"), ("state", "PRELEASED"))) not in before
        assert value(before, "coordinator_oldest_open_transaction_age_seconds", sink="views") > 0
        admin.abort("views", 0, attempt, None, "operator")  # admin: no generation needed
        time.sleep(2.1)
        after = scrape(service.url)
    finally:
        admin.close()
    assert value(after, "coordinator_open_transactions", sink="views", state="LEASED") == 0
    assert value(after, "coordinator_oldest_open_transaction_age_seconds", sink="views") == 0
    assert value(after, "coordinator_checkpoint_outcomes_total", sink="views", outcome="aborted") == 1


def test_lso_lag_is_exported_when_partitions_are_observed(coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    """GET /v1/sinks/{sink}/partitions sets the lag gauge (high watermark - last stable offset);
    the recorded observations stand in for a broker here."""
    app = create_app(coordinator, admin_token=ADMIN, token_secret=b"k")
    with TestClient(app) as http:
        admin = ProtocolClient(http, ADMIN)
        admin.register_sink("lagging", "lag", topics=["out"])
        kafka.partitions = [PartitionStability("out", 0, 120, 100), PartitionStability("out", 1, 50, 50)]
        admin.request("GET", "/v1/sinks/lagging/partitions?min_stall_s=0")
        text = admin.request("GET", "/metrics", expect=None).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert value(samples, "coordinator_partition_lso_lag_records", sink="lagging", topic="out", partition="0") == 20
    assert value(samples, "coordinator_partition_lso_lag_records", sink="lagging", topic="out", partition="1") == 0


# --- the Grafana dashboard ---------------------------------------------------------------------


def dashboard_expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    return exprs


def test_dashboard_is_valid_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["__inputs"][0]["name"] == "DS_PROMETHEUS" and dash["__inputs"][0]["pluginId"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]


def test_dashboard_uses_only_metrics_the_service_exports(service: ServiceProcess) -> None:
    traffic_through(service)
    exported = exported_names(service.url)
    used = {name for expr in dashboard_expressions() for name in re.findall(r"\bcoordinator_[a-z0-9_]+", expr)}
    assert used, "no metric found in the dashboard"
    assert used - exported == set(), f"the dashboard queries metrics the service does not export: {used - exported}"
    # and every metric the issue asks for has a panel
    for required in ("coordinator_checkpoint_outcomes_total", "coordinator_commit_duration_seconds_bucket",
                     "coordinator_abort_duration_seconds_bucket", "coordinator_open_transactions",
                     "coordinator_transactions_near_timeout", "coordinator_oldest_open_transaction_age_seconds",
                     "coordinator_fenced_requests_total", "coordinator_lingering_transactions_found_total",
                     "coordinator_lingering_transactions_aborted_total", "coordinator_partition_lso_lag_records",
                     "coordinator_recovery_iterations_total", "coordinator_recovery_errors_total",
                     "coordinator_http_request_duration_seconds_bucket", "coordinator_history_pruned_batches_total"):
        assert required in used, f"no dashboard panel queries {required}"
    # gauges that only the recovery leader keeps current (other replicas, and a former leader, keep
    # the last value they set): the panels read the leader's, not the max over replicas
    # (coordinator_sink_halted is read from the database by every replica at scrape time)
    for gauge in ("coordinator_transactions_near_timeout", "coordinator_partition_lso_lag_records"):
        exprs = [expr for expr in dashboard_expressions() if gauge in expr]
        assert exprs and all("and on (instance) (coordinator_recovery_leader == 1)" in x for x in exprs), exprs


def test_recovery_loop_observes_the_lso_lag(coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    """The leader observes the partitions of a sink with a transaction in flight at each pass, so
    the lag gauge stays current without anyone calling the partitions endpoint; once the
    transaction ended, the gauge follows the broker back to 0 (a stale lag would keep an alert
    firing for a sink that has nothing in flight any more)."""
    from prometheus_client import REGISTRY

    from coordinator.protocol.model import PartitionResult, PrecommitRecord
    from coordinator.service import SinkSpec
    from coordinator.service.recovery import RecoveryLoop

    coordinator.register_sink(SinkSpec("looped", "lp", "kafka:9092", ["events"]), "admin")
    gen, _ = coordinator.start_generation("looped", "q", "r", "driver")
    coordinator.begin_checkpoint("looped", 0, gen, "driver", partitions=1)
    lease = coordinator.lease("looped", 0, 1, gen, 0, 1).lease  # a try writes: its transaction holds the LSO
    kafka.partitions = [PartitionStability("events", 3, 40, 33)]
    loop = RecoveryLoop(coordinator, interval_ms=100, leader_ttl_ms=10_000, sweep_interval_ms=None)
    lag = {"sink": "looped", "topic": "events", "partition": "3"}
    try:
        report = loop.run_once()
        assert report.leader and all(not r.errors for r in report.sinks.values()), report
        assert REGISTRY.get_sample_value("coordinator_partition_lso_lag_records", lag) == 7
        coordinator.commit("looped", 0, 1, gen, [PartitionResult(0, lease.id, PrecommitRecord(1, 500, 0, 7, 70))],
                           "driver")
        kafka.partitions = [PartitionStability("events", 3, 45, 45)]  # the transaction ended
        loop.run_once()
        assert REGISTRY.get_sample_value("coordinator_partition_lso_lag_records", lag) == 0
    finally:
        loop.stop()


def test_commit_refused_by_the_timeout_gate_is_counted(coordinator: Coordinator, clock: ManualClock) -> None:
    """Through the API in-process (the injected clock moves the winner into its commit margin):
    the refusal is a deadline_refused outcome and a fenced request with its 409 reason."""
    from prometheus_client import REGISTRY

    app = create_app(coordinator, admin_token=ADMIN, token_secret=b"k")
    sample = REGISTRY.get_sample_value
    refused_before = sample("coordinator_checkpoint_outcomes_total", {"sink": "gated", "outcome": "deadline_refused"}) or 0
    fenced_before = sample("coordinator_fenced_requests_total", {"reason": "transaction_deadline_too_close"}) or 0
    aborts_before = sample("coordinator_abort_duration_seconds_count", {"sink": "gated"}) or 0
    with TestClient(app) as http:
        admin = ProtocolClient(http, ADMIN)
        admin.register_sink("gated", "gt", transaction_timeout_ms=60_000, commit_margin_ms=10_000)
        gen = admin.start_generation("gated", "q", "r")["generation"]
        attempt = admin.begin("gated", 0, gen)["attempt"]
        lease = admin.lease("gated", 0, attempt, gen, 0, task_attempt_id=1)
        clock.advance(ms=55_000)  # 5 s left: inside the 10 s margin
        refused = admin.commit("gated", 0, attempt, gen, {0: Winner.of(lease, producer_id=5)}, expect=409)
    assert refused["error"]["reason"] == "transaction_deadline_too_close"
    assert sample("coordinator_checkpoint_outcomes_total", {"sink": "gated", "outcome": "deadline_refused"}) == refused_before + 1
    assert sample("coordinator_fenced_requests_total", {"reason": "transaction_deadline_too_close"}) == fenced_before + 1
    assert sample("coordinator_abort_duration_seconds_count", {"sink": "gated"}) == aborts_before + 1  # its transaction
    assert sample("coordinator_checkpoint_outcomes_total", {"sink": "gated", "outcome": "committed"}) is None


def test_http_latency_of_dashboard_routes_is_labelled_with_the_mount(coordinator: Coordinator) -> None:
    """The dashboard is a mounted app: its routes are labelled with their full template, so they
    are neither confused with the API's (the dashboard's "/" is not the API's "/") nor raw paths."""
    from prometheus_client import REGISTRY

    def counts() -> dict[tuple[str, str], float]:
        return {(s.labels["route"], s.labels["status"]): s.value
                for f in REGISTRY.collect() if f.name == "coordinator_http_request_duration_seconds"
                for s in f.samples if s.name.endswith("_count") and s.labels["method"] == "GET"}

    before = counts()
    app = create_app(coordinator, admin_token=ADMIN, token_secret=b"k")
    with TestClient(app) as http:
        for path in ("/dashboard/sinks/orders", "/dashboard/sinks/views", "/dashboard/", "/",
                     "/dashboard/static/dashboard.js", "/dashboard/no/such/page"):
            http.get(path, follow_redirects=False)
    after = counts()
    grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grown == {
        ("/dashboard/sinks/{name}", "303"): 2,  # not logged in: to the login page
        ("/dashboard/", "303"): 1,
        ("/", "307"): 1,  # the API's root, to the dashboard
        ("/dashboard/static", "200"): 1,  # the static mount, not a series per file
        ("/dashboard", "404"): 1,  # inside the dashboard's mount, no route of it
    }
