"""Broker observations of the wire control plane (`KafkaWireControlPlane.check_broker`,
`list_open_transactions`, `partition_stability`) and the coordinator's lingering-transaction
sweep, on the real Kafka broker (tests/fixtures/real_kafka.py): KIP-664 ListTransactions /
DescribeTransactions / DescribeProducers answered by Kafka's own transaction coordinator and
partition leader, DescribeConfigs reporting `transaction.max.timeout.ms`, ListOffsets at
READ_COMMITTED stopping at an open transaction's first offset, and authorization refusals from
Kafka's ACL authorizer on the broker's SASL/SCRAM listener.

The fault proxy in front of the broker stands in for one thing only: an advertised address nobody
answers at (`refuse_connections`), the classic "Timed out waiting for a node assignment".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fixtures.kafka_producers import (
    partition_log,
    run_transactional_producer,
    run_transactional_producers,
    settled_partition_log,
)
from fixtures.real_kafka import SCRAM_PASSWORD, SCRAM_USER, RealKafka
from sqlalchemy import Engine

from coordinator.http.api import create_app
from coordinator.service.clock import ManualClock
from coordinator.kafka.control_plane import BrokerCheck, ControlPlaneError, KafkaTarget, PreparedTransaction
from coordinator.kafka.wire.control_plane import KafkaWireControlPlane
from coordinator.protocol import errors as e
from coordinator.service import Coordinator, Limits, SinkSpec
from localkafka import free_port

ADMIN = "test-admin-token-7f3a"
ACTOR = "test"
SCRAM = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
         "sasl_plain_username": SCRAM_USER, "sasl_plain_password": SCRAM_PASSWORD}


def tid(name: str = "tx") -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def target(bootstrap: str, timeout_ms: int = 60_000) -> KafkaTarget:
    return KafkaTarget("orders", bootstrap, timeout_ms)


def by_name(checks: list[BrokerCheck]) -> dict[str, BrokerCheck]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), names
    return {c.name: c for c in checks}


@pytest.fixture
def plane() -> Iterator[KafkaWireControlPlane]:
    p = KafkaWireControlPlane(request_timeout_ms=2_000, retry_budget_ms=4_000, retry_backoff_ms=40, retry_backoff_max_ms=300)
    yield p
    p.close()


@pytest.fixture
def scram_plane() -> Iterator[KafkaWireControlPlane]:
    """The control plane as user alice on the broker's SASL/SCRAM listener (subject to ACLs)."""
    p = KafkaWireControlPlane(request_timeout_ms=2_000, retry_budget_ms=4_000, retry_backoff_ms=40,
                              retry_backoff_max_ms=300, client_config=SCRAM)
    yield p
    p.close()


# --- check_broker -------------------------------------------------------------------------------


def test_check_broker_on_a_reachable_broker(real_kafka: RealKafka, plane: KafkaWireControlPlane) -> None:
    checks = by_name(plane.check_broker(target(real_kafka.bootstrap), tid("pfx"), set()))
    assert list(checks) == ["bootstrap", "advertised_listeners", "transactions_supported", "transaction_timeout",
                            "prefix_unused"]
    assert all(c.ok for c in checks.values()), checks
    assert "1 broker(s)" in checks["bootstrap"].verdict
    assert real_kafka.bootstrap in checks["advertised_listeners"].verdict
    assert "EndTxn (v0-v5)" in checks["transactions_supported"].verdict  # Kafka 4.x offers KIP-890's v5
    # read from the broker through DescribeConfigs: Kafka's default maximum
    assert checks["transaction_timeout"].verdict == ("the sink's transaction.timeout.ms 60000 is within the broker's "
                                                     "transaction.max.timeout.ms 900000")
    assert all(c.fix is None for c in checks.values())


def test_sink_timeout_above_the_brokers_maximum(real_kafka: RealKafka, plane: KafkaWireControlPlane) -> None:
    over = by_name(plane.check_broker(target(real_kafka.bootstrap, 1_000_000), tid("pfx"), set()))["transaction_timeout"]
    assert not over.ok
    assert "1000000 exceeds the broker's transaction.max.timeout.ms 900000" in over.verdict
    assert over.fix and "at least 1000000" in over.fix and "at most 900000" in over.fix
    # and the broker agrees: a producer with that timeout is refused
    with pytest.raises(ControlPlaneError) as exc:
        plane.abort(target(real_kafka.bootstrap, 1_000_000), tid())
    assert exc.value.code == "invalid_transaction_timeout"


def test_check_broker_with_an_unreachable_bootstrap_server(plane: KafkaWireControlPlane) -> None:
    closed = free_port()
    started = time.monotonic()
    checks = plane.check_broker(target(f"127.0.0.1:{closed}"), "pfx-", set())
    assert time.monotonic() - started < 2.0 + 2.0  # one request timeout, slack for load
    (only,) = checks
    assert only.name == "bootstrap" and not only.ok
    assert only.verdict.startswith(f"cannot reach any bootstrap server 127.0.0.1:{closed}")
    assert only.fix and "kafka.bootstrap.servers" in only.fix and "network" in only.fix


def test_check_broker_when_the_advertised_listener_is_unreachable(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane
) -> None:
    """Bootstrapping at the broker's PROXIED listener works, but it advertises the proxy's address,
    where (for this test) nobody answers."""
    node = kafka_faults.cluster.nodes[0]
    kafka_faults.proxy.refuse_connections = True
    checks = by_name(plane.check_broker(target(f"127.0.0.1:{node.proxied_port}"), "pfx-", set()))
    assert checks["bootstrap"].ok  # the bootstrap address itself answers metadata
    listeners = checks["advertised_listeners"]
    assert not listeners.ok
    assert f"at 127.0.0.1:{node.advertised_proxy_port}" in listeners.verdict and "cannot reach" in listeners.verdict
    assert listeners.fix and "advertised.listeners" in listeners.fix
    assert checks["transactions_supported"].ok  # read from the bootstrap connection's ApiVersions
    for name in ("transaction_timeout", "prefix_unused"):
        assert not checks[name].ok and "no broker is reachable at its advertised address" in checks[name].verdict
        assert checks[name].fix == listeners.fix


def test_sink_registration_runs_the_broker_checks(real_kafka: RealKafka, plane: KafkaWireControlPlane, engine: Engine,
                                                 clock: ManualClock) -> None:
    c = Coordinator(engine, plane, clock=clock, limits=Limits(max_partitions=16))
    try:
        sink, created = c.register_sink(SinkSpec("orders", tid("pfx"), real_kafka.bootstrap, ["out"]), "admin")
        assert created and sink.bootstrap_servers == real_kafka.bootstrap
        with pytest.raises(e.Invalid) as too_long:
            c.register_sink(SinkSpec("slow", tid("pfx"), real_kafka.bootstrap, ["out"],
                                     transaction_timeout_ms=1_000_000), "admin")
        assert too_long.value.reason == "transaction_timeout_above_broker_max" and "900000" in too_long.value.message
        closed = free_port()
        with pytest.raises(e.Invalid) as unreachable:
            c.register_sink(SinkSpec("unreachable", tid("pfx"), f"127.0.0.1:{closed}", ["out"]), "admin")
        assert unreachable.value.reason == "broker_check_failed"
        assert f"cannot reach any bootstrap server 127.0.0.1:{closed}" in unreachable.value.message
        assert [s.name for s in c.list_sinks()] == ["orders"]
        skipped, _ = c.register_sink(SinkSpec("later", tid("pfx"), f"127.0.0.1:{closed}", ["out"]), "admin",
                                     check_broker=False)
        assert skipped.name == "later"
    finally:
        c.close()


def test_prefix_in_use_by_a_producer_the_coordinator_does_not_know(
    real_kafka: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = real_kafka.create_topic(1)
    prefix = tid("orders-eos") + "-"
    ours, stranger = f"{prefix}0", f"{prefix}legacy-3"
    s_ours, s_stranger, _ = run_transactional_producers(
        real_kafka.bootstrap, [(ours, topic, 0), (stranger, topic, 0), (tid("other-app"), topic, 0)], records=1)
    plane.commit(target(real_kafka.bootstrap), PreparedTransaction(ours, s_ours.producer_id, s_ours.producer_epoch))

    clash = by_name(plane.check_broker(target(real_kafka.bootstrap), prefix, {ours}))["prefix_unused"]
    clean = by_name(plane.check_broker(target(real_kafka.bootstrap), prefix, {ours, stranger}))["prefix_unused"]

    assert not clash.ok
    assert clash.verdict == (f"prefix {prefix!r} already in use by producers the coordinator does not know: "
                             f"{stranger} (producer id {s_stranger.producer_id}, Ongoing)")
    assert clash.fix and "transactional_id_prefix" in clash.fix
    assert clean.ok and "other-app" not in clean.verdict
    plane.abort(target(real_kafka.bootstrap), stranger)
    done = by_name(plane.check_broker(target(real_kafka.bootstrap), prefix, {ours}))["prefix_unused"]
    assert not done.ok and f"{stranger} (producer id {s_stranger.producer_id}, " in done.verdict  # remembered, any state


# --- SASL/SCRAM and ACLs --------------------------------------------------------------------------


def _acls(real_kafka: RealKafka, bindings: list[Any], *, delete: bool = False) -> None:
    from confluent_kafka.admin import AdminClient, AclBindingFilter

    admin = AdminClient({"bootstrap.servers": real_kafka.bootstrap, "log_level": 0})
    if delete:
        filters = [AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation,
                                    b.permission_type) for b in bindings]
        for f in admin.delete_acls(filters).values():
            f.result(30)
    else:
        for f in admin.create_acls(bindings).values():
            f.result(30)
    time.sleep(0.5)  # ACL changes reach the authorizer through the metadata log


def _binding(resource: str, name: str, operation: str, pattern: str = "LITERAL") -> Any:
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    return AclBinding(ResourceType[resource], name, ResourcePatternType[pattern], f"User:{SCRAM_USER}", "*",
                      AclOperation[operation], AclPermissionType.ALLOW)


def test_scram_principal_without_acls_gets_named_refusals_then_works_once_granted(
    real_kafka: RealKafka, plane: KafkaWireControlPlane, scram_plane: KafkaWireControlPlane
) -> None:
    """The coordinator on a SASL/SCRAM listener with Kafka's ACL authorizer: every refusal the
    broker sends is named with the ACL that is missing, and the same calls work once granted."""
    topic = real_kafka.create_topic(1)
    prefix = tid("secure") + "-"
    stats = run_transactional_producer(real_kafka.bootstrap, f"{prefix}0", topic, records=2)
    tg = target(real_kafka.sasl_bootstrap)

    checks = by_name(scram_plane.check_broker(tg, prefix, set()))
    assert checks["bootstrap"].ok and checks["advertised_listeners"].ok  # authenticated: SCRAM works
    timeout = checks["transaction_timeout"]
    assert not timeout.ok and timeout.verdict.startswith("not authorized")
    assert "CLUSTER_AUTHORIZATION_FAILED" in timeout.verdict and "lacks DescribeConfigs on the cluster" in timeout.verdict
    assert timeout.fix and "grant the coordinator's principal" in timeout.fix
    with pytest.raises(ControlPlaneError) as refused:
        scram_plane.commit(tg, PreparedTransaction(stats.transactional_id, stats.producer_id, stats.producer_epoch))
    assert (refused.value.code, refused.value.retriable) == ("transactional_id_authorization_failed", False)
    assert partition_log(real_kafka.bootstrap, topic, 0).has_open_transaction

    grants = [_binding("BROKER", "kafka-cluster", "DESCRIBE_CONFIGS"),
              _binding("TRANSACTIONAL_ID", prefix, "WRITE", "PREFIXED"),
              _binding("TRANSACTIONAL_ID", prefix, "DESCRIBE", "PREFIXED")]
    _acls(real_kafka, grants)
    try:
        granted = by_name(scram_plane.check_broker(tg, prefix, set()))
        assert granted["transaction_timeout"].ok and "900000" in granted["transaction_timeout"].verdict
        # ListTransactions lists what alice may Describe: the open id under the prefix
        assert not granted["prefix_unused"].ok and f"{prefix}0" in granted["prefix_unused"].verdict
        scram_plane.commit(tg, PreparedTransaction(stats.transactional_id, stats.producer_id, stats.producer_epoch))
        assert [m.value() for m in real_kafka.read_committed(topic)] == [b"record-0", b"record-1"]
    finally:
        _acls(real_kafka, grants, delete=True)


# --- list_open_transactions and the lingering sweep ----------------------------------------------


def test_open_transactions_under_the_prefix_are_listed_and_described(
    real_kafka: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = real_kafka.create_topic(2)
    prefix = tid("sweep") + "-"
    before_ms = int(time.time() * 1000)
    opened, committed, _ = run_transactional_producers(
        real_kafka.bootstrap, [(f"{prefix}0", topic, 1), (f"{prefix}1", topic, 0), (tid("other-app"), topic, 0)],
        records=1, transaction_timeout_ms=45_000)
    plane.commit(target(real_kafka.bootstrap), PreparedTransaction(committed.transactional_id, committed.producer_id,
                                                                   committed.producer_epoch))

    # EndTxn is answered once PrepareCommit is logged; until its markers are written the committed
    # transaction is still listed (as PrepareCommit: it still holds its partitions' LSO)
    deadline = time.monotonic() + 30
    while True:
        found = plane.list_open_transactions(target(real_kafka.bootstrap), prefix)
        listed = {t.transactional_id: t.state for t in found}
        assert listed.get(opened.transactional_id) == "Ongoing", listed
        if committed.transactional_id not in listed or time.monotonic() > deadline:
            break
        assert listed[committed.transactional_id] == "PrepareCommit", listed
        time.sleep(0.2)

    assert [(t.transactional_id, t.producer_id, t.producer_epoch, t.state, t.partitions) for t in found] == [
        (opened.transactional_id, opened.producer_id, opened.producer_epoch, "Ongoing", ((topic, 1),)),
    ]
    (txn,) = found
    assert txn.timeout_ms == 45_000
    assert txn.started_at_ms is not None and before_ms - 1_000 <= txn.started_at_ms <= int(time.time() * 1000)


def test_the_sweep_aborts_an_open_transaction_the_database_does_not_explain(
    real_kafka: RealKafka, plane: KafkaWireControlPlane, engine: Engine, clock: ManualClock
) -> None:
    """A producer under the sink's prefix the coordinator never leased (an old deployment's)
    holds the last stable offset: the sweep finds it with KIP-664 and aborts it, and readers move on."""
    topic = real_kafka.create_topic(1)
    prefix = tid("orders-eos")
    c = Coordinator(engine, plane, clock=clock, limits=Limits(max_partitions=16))
    try:
        c.register_sink(SinkSpec("orders", prefix, real_kafka.bootstrap, [topic]), ACTOR)
        stranger = run_transactional_producer(real_kafka.bootstrap, f"{prefix}-77", topic, records=2)
        log = partition_log(real_kafka.bootstrap, topic, 0)
        assert (log.high_watermark, log.last_stable_offset) == (2, 0)

        out = c.sweep_lingering("orders")

        assert [t.transactional_id for t in out.found] == [stranger.transactional_id]
        assert out.aborted == [stranger.transactional_id] and not out.failed
        log = settled_partition_log(real_kafka.bootstrap, topic, 0)
        assert log.markers(stranger.producer_id) == ["abort"] and log.last_stable_offset == log.high_watermark
        assert real_kafka.read_committed(topic) == []
        assert c.sweep_lingering("orders").found == []  # nothing open any more
    finally:
        c.close()


# --- partition_stability ----------------------------------------------------------------------


def test_partition_stability_reads_kafkas_offsets_and_names_the_blocking_producer(
    real_kafka: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = real_kafka.create_topic(3)
    tg = target(real_kafka.bootstrap)
    assert [(p.partition, p.high_watermark, p.last_stable_offset) for p in plane.partition_stability(tg, [topic])] == [
        (0, 0, 0), (1, 0, 0), (2, 0, 0)]
    one, three = run_transactional_producers(real_kafka.bootstrap, [(tid(), topic, 0), (tid(), topic, 2)], records=3)
    opened = {p.partition: p for p in plane.partition_stability(tg, [topic])}
    # a 3-record open transaction at offset 0: HW 3, LSO held at its first offset
    assert (opened[0].high_watermark, opened[0].last_stable_offset) == (3, 0)
    assert (opened[0].blocking_producer_id, opened[0].blocking_producer_epoch, opened[0].blocking_txn_start_offset) == (
        one.producer_id, one.producer_epoch, 0)  # named by DescribeProducers on the leader
    assert (opened[1].high_watermark, opened[1].last_stable_offset, opened[1].blocking_producer_id) == (0, 0, None)
    assert opened[2].blocking_producer_id == three.producer_id

    plane.commit(tg, PreparedTransaction(one.transactional_id, one.producer_id, one.producer_epoch))
    # EndTxn answers once the decision is logged; the COMMIT marker is written (and HW and LSO move) right after
    deadline = time.monotonic() + 30
    while True:
        committed = {p.partition: p for p in plane.partition_stability(tg, [topic])}
        if (committed[0].high_watermark, committed[0].last_stable_offset) == (4, 4) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (committed[0].high_watermark, committed[0].last_stable_offset) == (4, 4)  # data + COMMIT marker
    assert committed[0].blocking_producer_id is None

    # a second transaction opened after committed data holds the LSO at its own first offset
    later = run_transactional_producer(real_kafka.bootstrap, tid(), topic, partition=0, records=1)
    again = {p.partition: p for p in plane.partition_stability(tg, [topic])}[0]
    assert (again.high_watermark, again.last_stable_offset, again.blocking_txn_start_offset) == (5, 4, 4)
    assert again.blocking_producer_id == later.producer_id
    fetched = partition_log(real_kafka.bootstrap, topic, 0)
    assert (fetched.high_watermark, fetched.last_stable_offset) == (5, 4)  # Fetch agrees with ListOffsets

    with pytest.raises(ControlPlaneError) as missing:
        plane.partition_stability(tg, [tid("no-such-topic")])
    assert missing.value.code == "unknown_topic_or_partition"
    assert plane.partition_stability(tg, []) == []


def test_partitions_endpoint_over_the_wire_names_the_stuck_lease(
    real_kafka: RealKafka, plane: KafkaWireControlPlane, engine: Engine, clock: ManualClock
) -> None:
    """End to end: a lease's producer (another process) leaves its transaction open; two calls
    of GET /partitions see the stable offset not moving and name the lease (DescribeProducers)."""
    broker = real_kafka
    topic = broker.create_topic(1)
    c = Coordinator(engine, plane, clock=clock, limits=Limits(max_partitions=16))
    try:
        c.register_sink(SinkSpec(name="orders", transactional_id_prefix=tid("orders-eos"), bootstrap_servers=broker.bootstrap,
                                 topics=[topic], transaction_timeout_ms=60_000), ACTOR)
        gen, _ = c.start_generation("orders", "q-1", "r-1", ACTOR)
        begun = c.begin_checkpoint("orders", 0, gen, ACTOR)
        assert begun.attempt is not None
        lease = c.begin_partition("orders", 0, begun.attempt.number, gen, 0, 1)
        run_transactional_producer(broker.bootstrap, lease.transactional_id, topic, records=1)  # left open

        with TestClient(create_app(c, admin_token=ADMIN, token_secret=b"s")) as http:
            headers = {"Authorization": f"Bearer {ADMIN}"}
            first = http.get("/v1/sinks/orders/partitions", params={"min_stall_s": 0}, headers=headers).json()
            second = http.get("/v1/sinks/orders/partitions", params={"min_stall_s": 0}, headers=headers).json()
            assert first["partitions"][0]["stuck"] is False
            (row,) = second["partitions"]
            assert (row["high_watermark"], row["last_stable_offset"], row["lag"], row["stuck"]) == (1, 0, 1, True)
            assert row["blocking_transaction"]["transactional_id"] == lease.transactional_id
            assert row["blocking_transaction"]["lease_id"] == lease.id and row["blocking_transaction"]["known"] is True

            checks = http.post("/v1/sinks/orders/broker-check", headers=headers)
            assert checks.status_code == 200
            verdicts = {v["name"]: v for v in checks.json()}
            assert verdicts["bootstrap"]["ok"] and verdicts["advertised_listeners"]["ok"]
            assert verdicts["transaction_timeout"]["ok"] and verdicts["prefix_unused"]["ok"]  # its own id is known
    finally:
        c.close()
