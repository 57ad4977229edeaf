"""Broker observations of the wire control plane (`KafkaWireControlPlane.check_broker`,
`list_open_transactions`, `partition_stability`) against the Tansu broker, and through the
fault-injecting proxy answering the KIP-664 / DescribeConfigs requests Tansu lacks with recorded
responses (built with kafka-python's protocol classes).

What Tansu 0.6.0 (memory storage) was observed to do, and these tests pin:
- ApiVersions offers InitProducerId v0-5, AddPartitionsToTxn v0-5, EndTxn v0-4, DescribeConfigs
  v0-4, ListOffsets v0-9, Metadata v0-12 -- and NOT ListTransactions (66), DescribeTransactions
  (65) or DescribeProducers (61). So on Tansu the lingering-transaction sweep is unavailable
  (`list_open_transactions` raises `UnsupportedByBroker`, code "unsupported_by_broker"), the
  prefix check says so, and `partition_stability` cannot name the blocking producer.
- DescribeConfigs on the broker resource with configuration_keys = null answers NONE with an
  EMPTY config list (no transaction.max.timeout.ms); with a key list it fails to decode the
  request and closes the connection (hence the control plane always asks for all keys).
- Bootstrap reachability and advertised-listener reachability are real: Tansu started with an
  advertised listener on a closed port answers metadata on its real port and names the closed
  one, exactly the "Timed out waiting for a node assignment" situation.
- ListOffsets(LATEST) is NOT faithful: at READ_UNCOMMITTED it answers the base offset of the
  last batch + 1 (the high watermark only when that batch holds one record; a 3-record batch at
  offset 0 gives 1 where Fetch says 3); at READ_COMMITTED with a transaction open it answers 0
  whatever the transaction's first offset (Fetch reports the correct last stable offset). With
  no transaction open both agree with Fetch. The tests use one-record transactions on fresh
  topics, where Tansu's answers coincide with Kafka's, and pin the two divergences.

What needs real Kafka (the docker-compose e2e suite): ListTransactions / DescribeTransactions /
DescribeProducers answers from a real transaction coordinator and partition leader (here they are
recorded responses: the tests prove request routing, parsing, filtering and the verdicts, not
the broker's answers), DescribeConfigs reporting transaction.max.timeout.ms, a last stable offset
from ListOffsets(READ_COMMITTED) that stops at an open transaction's first offset, authorization
errors from real ACLs (here injected codes), and read_committed visibility itself.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kafka.protocol.admin.configs import DescribeConfigsRequest, DescribeConfigsResponse
from kafka.protocol.admin.transactions import (
    DescribeProducersRequest,
    DescribeProducersResponse,
    DescribeTransactionsRequest,
    DescribeTransactionsResponse,
    ListTransactionsRequest,
    ListTransactionsResponse,
)
from kafka_broker import (  # noqa: F401 - fixtures
    faulty,
    KafkaFaultProxy,
    TansuBroker,
    free_port,
    partition_log,
    proxied,
    run_transactional_producer,
    run_transactional_producers,
    tansu,
)
from sqlalchemy import Engine

from coordinator.api import create_app
from coordinator.clock import ManualClock
from coordinator.kafka_control import (
    BrokerCheck,
    ControlPlaneError,
    KafkaTarget,
    PreparedTransaction,
)
from coordinator.kafka_wire import (
    OPEN_STATES,
    KafkaWireControlPlane,
    UnsupportedByBroker,
)
from coordinator.protocol import errors as e
from coordinator.protocol.rules import PrecommitRequest
from coordinator.service import Coordinator, Limits, SinkSpec

LIST_TXN, DESCRIBE_TXN, DESCRIBE_PRODUCERS, DESCRIBE_CONFIGS = 66, 65, 61, 32
ADMIN = "test-admin-token-7f3a"
ACTOR = "test"


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
    p = KafkaWireControlPlane(request_timeout_ms=1_000, retry_budget_ms=2_500, retry_backoff_ms=40, retry_backoff_max_ms=300)
    yield p
    p.close()


# --- recorded responses (what a real Kafka answers), kafka-python protocol classes --------------


def list_transactions_answer(rows: list[tuple[str, int, str]], seen: list[Any] | None = None,
                             error_code: int = 0) -> Callable[[int, bytes], Any]:
    """Answers ListTransactions like a broker holding `rows`, honouring the request's state filters."""

    def respond(version: int, request: bytes) -> Any:
        asked = ListTransactionsRequest.decode(request, version=version, header=True)
        if seen is not None:
            seen.append(asked)
        states = set(asked.state_filters)
        return ListTransactionsResponse(version=version, throttle_time_ms=0, error_code=error_code, unknown_state_filters=[],
                                        transaction_states=[] if error_code else [
            ListTransactionsResponse.TransactionState(transactional_id=t, producer_id=p, transaction_state=s)
            for t, p, s in rows if not states or s in states
        ])

    return respond


def describe_transactions_answer(known: dict[str, tuple[int, int, str, list[tuple[str, int]]]]) -> Callable[[int, bytes], Any]:
    state = DescribeTransactionsResponse.TransactionState

    def respond(version: int, request: bytes) -> Any:
        asked = DescribeTransactionsRequest.decode(request, version=version, header=True).transactional_ids
        rows = []
        for t in asked:
            if t not in known:
                rows.append(state(error_code=105, transactional_id=t, transaction_state="", transaction_timeout_ms=-1,
                                  transaction_start_time_ms=-1, producer_id=-1, producer_epoch=-1, topics=[]))
                continue
            pid, epoch, s, parts = known[t]
            topics: dict[str, list[int]] = {}
            for topic, p in parts:
                topics.setdefault(topic, []).append(p)
            rows.append(state(error_code=0, transactional_id=t, transaction_state=s, transaction_timeout_ms=60_000,
                              transaction_start_time_ms=1_700_000_000_000, producer_id=pid, producer_epoch=epoch,
                              topics=[state.TopicData(topic=k, partitions=v) for k, v in topics.items()]))
        return DescribeTransactionsResponse(version=version, throttle_time_ms=0, transaction_states=rows)

    return respond


def broker_config_answer(configs: dict[str, str], error_code: int = 0) -> Callable[[int, bytes], Any]:
    result = DescribeConfigsResponse.DescribeConfigsResult
    entry = result.DescribeConfigsResourceResult

    def respond(version: int, request: bytes) -> Any:
        asked = DescribeConfigsRequest.decode(request, version=version, header=True).resources
        return DescribeConfigsResponse(version=version, throttle_time_ms=0, results=[result(
            error_code=error_code, error_message=None, resource_type=r.resource_type, resource_name=r.resource_name,
            configs=[] if error_code else [entry(name=k, value=v, read_only=True, is_default=False, config_source=5,
                                                 is_sensitive=False, synonyms=[], config_type=3, documentation=None)
                                           for k, v in configs.items()],
        ) for r in asked])

    return respond


def describe_producers_answer(active: dict[tuple[str, int], list[tuple[int, int, int]]],
                              seen: list[Any] | None = None) -> Callable[[int, bytes], Any]:
    topic_cls = DescribeProducersResponse.TopicResponse
    part_cls = topic_cls.PartitionResponse

    def respond(version: int, request: bytes) -> Any:
        asked = DescribeProducersRequest.decode(request, version=version, header=True)
        if seen is not None:
            seen.append(asked)
        return DescribeProducersResponse(version=version, throttle_time_ms=0, topics=[topic_cls(name=t.name, partitions=[
            part_cls(partition_index=p, error_code=0, error_message=None, active_producers=[
                part_cls.ProducerState(producer_id=pid, producer_epoch=epoch, last_sequence=0, last_timestamp=-1,
                                       coordinator_epoch=0, current_txn_start_offset=start)
                for pid, epoch, start in active.get((t.name, p), [])
            ]) for p in t.partition_indexes]) for t in asked.topics])

    return respond


# --- check_broker against Tansu ---------------------------------------------------------------


def test_check_broker_on_a_reachable_tansu(tansu: TansuBroker, plane: KafkaWireControlPlane) -> None:
    checks = by_name(plane.check_broker(target(tansu.bootstrap), tid("pfx"), set()))
    assert list(checks) == ["bootstrap", "advertised_listeners", "transactions_supported", "transaction_timeout",
                            "prefix_unused"]
    assert checks["bootstrap"].ok and "1 broker(s)" in checks["bootstrap"].verdict
    assert checks["advertised_listeners"].ok and f"127.0.0.1:{tansu.port}" in checks["advertised_listeners"].verdict
    assert checks["transactions_supported"].ok and "EndTxn (v0-v4)" in checks["transactions_supported"].verdict
    # Tansu answers DescribeConfigs, but without transaction.max.timeout.ms
    timeout = checks["transaction_timeout"]
    assert timeout.ok and "did not report transaction.max.timeout.ms" in timeout.verdict and "not verified" in timeout.verdict
    # Tansu lacks ListTransactions: the degraded verdict, not a crash
    prefix = checks["prefix_unused"]
    assert not prefix.ok
    assert prefix.verdict == ("broker does not support ListTransactions (KIP-664, Kafka >= 3.0): "
                              "lingering-transaction sweep unavailable")
    assert prefix.fix and "Kafka >= 3.0" in prefix.fix
    assert all(c.fix is None for c in checks.values() if c.ok)


def test_check_broker_with_an_unreachable_bootstrap_server(plane: KafkaWireControlPlane) -> None:
    closed = free_port()
    started = time.monotonic()
    checks = plane.check_broker(target(f"127.0.0.1:{closed}"), "pfx-", set())
    assert time.monotonic() - started < 1.0 + 2.0  # one request timeout, slack for load
    (only,) = checks
    assert only.name == "bootstrap" and not only.ok
    assert only.verdict.startswith(f"cannot reach any bootstrap server 127.0.0.1:{closed}")
    assert only.fix and "kafka.bootstrap.servers" in only.fix and "network" in only.fix


def test_sink_registration_runs_the_broker_checks(tansu: TansuBroker, plane: KafkaWireControlPlane, engine: Engine,
                                                 clock: ManualClock) -> None:
    c = Coordinator(engine, plane, clock=clock, limits=Limits(max_partitions=16))
    # Tansu cannot list transactional ids (no KIP-664): an unverifiable check does not block
    sink, created = c.register_sink(SinkSpec("orders", tid("pfx"), tansu.bootstrap, ["out"]), "admin")
    assert created and sink.bootstrap_servers == tansu.bootstrap
    closed = free_port()
    with pytest.raises(e.Invalid) as refused:
        c.register_sink(SinkSpec("unreachable", tid("pfx"), f"127.0.0.1:{closed}", ["out"]), "admin")
    assert refused.value.reason == "broker_check_failed"
    assert f"cannot reach any bootstrap server 127.0.0.1:{closed}" in refused.value.message
    assert [s.name for s in c.list_sinks()] == ["orders"]
    skipped, _ = c.register_sink(SinkSpec("later", tid("pfx"), f"127.0.0.1:{closed}", ["out"]), "admin", check_broker=False)
    assert skipped.name == "later"


def test_check_broker_when_the_advertised_listener_is_unreachable(
    tmp_path: Path, plane: KafkaWireControlPlane
) -> None:
    closed = free_port()  # what the broker tells clients to connect to; nothing listens there
    broker = TansuBroker(tmp_path / "tansu.log", advertised_port=closed).start()
    try:
        checks = by_name(plane.check_broker(target(f"127.0.0.1:{broker.port}"), "pfx-", set()))
    finally:
        broker.stop()
    assert checks["bootstrap"].ok  # the bootstrap address itself answers metadata
    listeners = checks["advertised_listeners"]
    assert not listeners.ok
    assert f"at 127.0.0.1:{closed}" in listeners.verdict and "cannot reach" in listeners.verdict
    assert "Timed out waiting for a node assignment" in listeners.verdict
    assert listeners.fix and "advertised.listeners" in listeners.fix
    assert checks["transactions_supported"].ok  # read from the bootstrap connection's ApiVersions
    for name in ("transaction_timeout", "prefix_unused"):
        assert not checks[name].ok and "no broker is reachable at its advertised address" in checks[name].verdict
        assert checks[name].fix == listeners.fix


# --- check_broker through the proxy: the answers real Kafka gives -----------------------------


def test_sink_timeout_above_the_brokers_maximum(faulty: tuple[TansuBroker, KafkaFaultProxy],
                                               plane: KafkaWireControlPlane) -> None:
    broker, proxy = faulty
    proxy.respond(DESCRIBE_CONFIGS, broker_config_answer({"log.retention.ms": "1", "transaction.max.timeout.ms": "30000"}))

    over = by_name(plane.check_broker(target(broker.bootstrap, 60_000), tid("pfx"), set()))["transaction_timeout"]
    within = by_name(plane.check_broker(target(broker.bootstrap, 20_000), tid("pfx"), set()))["transaction_timeout"]

    assert proxy.injected[DESCRIBE_CONFIGS] == 2
    assert not over.ok
    assert "60000 exceeds the broker's transaction.max.timeout.ms 30000" in over.verdict
    assert over.fix and "at least 60000" in over.fix and "at most 30000" in over.fix
    assert within.ok and "within the broker's transaction.max.timeout.ms 30000" in within.verdict


def test_prefix_in_use_by_a_producer_the_coordinator_does_not_know(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    broker, proxy = faulty
    prefix = tid("orders-eos") + "-"
    ours, stranger = f"{prefix}0", f"{prefix}legacy-3"
    seen: list[Any] = []
    proxy.advertise(LIST_TXN, 0, 1)
    proxy.respond(LIST_TXN, list_transactions_answer(
        [(ours, 11, "CompleteCommit"), (stranger, 12, "Empty"), ("other-app-1", 13, "Ongoing")], seen))

    clash = by_name(plane.check_broker(target(broker.bootstrap), prefix, {ours}))["prefix_unused"]
    clean = by_name(plane.check_broker(target(broker.bootstrap), prefix, {ours, stranger}))["prefix_unused"]

    assert not clash.ok
    assert f"prefix {prefix!r} already in use by producers the coordinator does not know: {stranger} (producer id 12, Empty)" \
        == clash.verdict
    assert clash.fix and "transactional_id_prefix" in clash.fix
    assert clean.ok and "other-app-1" not in clean.verdict
    assert len(seen) == 2 and all(r.state_filters == [] for r in seen)  # all states: ids remembered, not only open ones
    assert proxy.requests[LIST_TXN] == 2  # one broker, asked once per check


@pytest.mark.parametrize(("api", "code", "name", "phrase"), [
    (LIST_TXN, 31, "prefix_unused", "lacks Describe on the cluster"),
    (LIST_TXN, 53, "prefix_unused", "lacks Describe on the transactional ids under prefix"),
    (DESCRIBE_CONFIGS, 31, "transaction_timeout", "lacks DescribeConfigs on the cluster"),
])
def test_authorization_errors_are_named_as_such(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane, api: int, code: int, name: str, phrase: str
) -> None:
    broker, proxy = faulty
    proxy.advertise(LIST_TXN, 0, 1)
    if api == LIST_TXN:
        proxy.respond(LIST_TXN, list_transactions_answer([], error_code=code))
    else:
        proxy.respond(LIST_TXN, list_transactions_answer([]))
        proxy.respond(DESCRIBE_CONFIGS, broker_config_answer({}, error_code=code))

    checks = by_name(plane.check_broker(target(broker.bootstrap), "pfx-", set()))

    refused = checks[name]
    assert not refused.ok and refused.verdict.startswith("not authorized") and phrase in refused.verdict
    assert refused.fix and "grant the coordinator's principal" in refused.fix
    assert checks["bootstrap"].ok and checks["advertised_listeners"].ok  # the rest still ran


# --- list_open_transactions -------------------------------------------------------------------


def test_open_transaction_sweep_degrades_on_tansu(tansu: TansuBroker, plane: KafkaWireControlPlane) -> None:
    topic = tansu.create_topic(1)
    prefix = tid("sweep") + "-"
    run_transactional_producer(tansu.bootstrap, f"{prefix}0", topic, records=1)  # exits without committing
    assert partition_log(tansu.bootstrap, topic, 0).has_open_transaction  # there IS something to find

    started = time.monotonic()
    with pytest.raises(UnsupportedByBroker) as exc:
        plane.list_open_transactions(target(tansu.bootstrap), prefix)
    assert time.monotonic() - started < 1.0  # refused at once, no waiting out the retry budget
    assert isinstance(exc.value, ControlPlaneError)
    assert (exc.value.code, exc.value.retriable) == ("unsupported_by_broker", False)
    assert str(exc.value) == ("broker does not support ListTransactions (KIP-664, Kafka >= 3.0): "
                              "lingering-transaction sweep unavailable")


def test_open_transactions_under_the_prefix_are_listed_and_described(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    broker, proxy = faulty
    topic = broker.create_topic(2)
    prefix = tid("sweep") + "-"
    # a real producer leaves a real transaction open; the proxy answers for the transaction coordinator
    stats = run_transactional_producer(broker.bootstrap, f"{prefix}0", topic, partition=1, records=1)
    seen: list[Any] = []
    proxy.advertise(LIST_TXN, 0, 1)
    proxy.advertise(DESCRIBE_TXN, 0, 0)
    proxy.respond(LIST_TXN, list_transactions_answer([
        (stats.transactional_id, stats.producer_id, "Ongoing"),
        (f"{prefix}1", 77, "PrepareCommit"),
        (f"{prefix}2", 78, "CompleteAbort"),  # filtered out by the broker (state filter)
        (f"{prefix}gone", 79, "Ongoing"),  # completes and expires between list and describe
        ("other-app-0", 80, "Ongoing"),  # another prefix
    ], seen))
    proxy.respond(DESCRIBE_TXN, describe_transactions_answer({
        stats.transactional_id: (stats.producer_id, stats.producer_epoch, "Ongoing", [(topic, 1)]),
        f"{prefix}1": (77, 4, "PrepareCommit", [(topic, 0), (topic, 1)]),
        "other-app-0": (80, 0, "Ongoing", []),
    }))

    found = plane.list_open_transactions(target(broker.bootstrap), prefix)

    assert [(t.transactional_id, t.producer_id, t.producer_epoch, t.state, t.partitions) for t in found] == [
        (stats.transactional_id, stats.producer_id, stats.producer_epoch, "Ongoing", ((topic, 1),)),
        (f"{prefix}1", 77, 4, "PrepareCommit", ((topic, 0), (topic, 1))),
    ]
    assert all(t.started_at_ms == 1_700_000_000_000 and t.timeout_ms == 60_000 for t in found)
    assert [r.state_filters for r in seen] == [list(OPEN_STATES)]
    assert proxy.requests[DESCRIBE_TXN] == 1


# --- partition_stability ----------------------------------------------------------------------


def test_partition_stability_on_tansu(tansu: TansuBroker, plane: KafkaWireControlPlane) -> None:
    topic = tansu.create_topic(3)
    tg = target(tansu.bootstrap)
    assert [(p.partition, p.high_watermark, p.last_stable_offset) for p in plane.partition_stability(tg, [topic])] == [
        (0, 0, 0), (1, 0, 0), (2, 0, 0)]
    one, _ = run_transactional_producers(tansu.bootstrap, [(tid(), topic, 0), (tid(), topic, 2)], records=1)
    opened = {p.partition: p for p in plane.partition_stability(tg, [topic])}
    # one open one-record transaction at offset 0: Tansu's answer is Kafka's (HW 1, LSO 0)
    assert (opened[0].high_watermark, opened[0].last_stable_offset) == (1, 0)
    assert opened[0].blocking_producer_id is None  # no DescribeProducers on Tansu
    assert (opened[1].high_watermark, opened[1].last_stable_offset) == (0, 0)

    plane.commit(tg, PreparedTransaction(one.transactional_id, one.producer_id, one.producer_epoch))
    committed = {p.partition: p for p in plane.partition_stability(tg, [topic])}
    assert (committed[0].high_watermark, committed[0].last_stable_offset) == (2, 2)  # data + COMMIT marker

    # the divergences from Kafka, pinned so a change in Tansu is noticed:
    run_transactional_producer(tansu.bootstrap, tid(), topic, partition=0, records=1)  # open at offset 2
    run_transactional_producer(tansu.bootstrap, tid(), topic, partition=1, records=3)  # one 3-record batch
    diverged = {p.partition: p for p in plane.partition_stability(tg, [topic])}
    fetched0, fetched1 = partition_log(tansu.bootstrap, topic, 0), partition_log(tansu.bootstrap, topic, 1)
    assert (fetched0.high_watermark, fetched0.last_stable_offset) == (3, 2)  # the truth, from Fetch
    assert (diverged[0].high_watermark, diverged[0].last_stable_offset) == (3, 0)  # Kafka: (3, 2)
    assert (fetched1.high_watermark, fetched1.last_stable_offset) == (3, 0)
    assert (diverged[1].high_watermark, diverged[1].last_stable_offset) == (1, 0)  # Kafka: (3, 0)

    with pytest.raises(ControlPlaneError) as missing:
        plane.partition_stability(tg, [tid("no-such-topic")])
    assert missing.value.code == "unknown_topic_or_partition"
    assert plane.partition_stability(tg, []) == []


def test_blocking_producer_is_named_with_describe_producers(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    broker, proxy = faulty
    topic = broker.create_topic(2)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic, partition=1, records=1)
    seen: list[Any] = []
    proxy.advertise(DESCRIBE_PRODUCERS, 0, 0)
    proxy.respond(DESCRIBE_PRODUCERS, describe_producers_answer(
        {(topic, 1): [(stats.producer_id + 100, 0, -1), (stats.producer_id, stats.producer_epoch, 0)]}, seen))

    stability = {p.partition: p for p in plane.partition_stability(target(broker.bootstrap), [topic])}

    blocked = stability[1]
    assert (blocked.high_watermark, blocked.last_stable_offset) == (1, 0)
    assert (blocked.blocking_producer_id, blocked.blocking_producer_epoch, blocked.blocking_txn_start_offset) == (
        stats.producer_id, stats.producer_epoch, 0)
    assert stability[0].blocking_producer_id is None
    # asked only about the partition whose stable offset lags
    assert [[(t.name, list(t.partition_indexes)) for t in r.topics] for r in seen] == [[(topic, [1])]]


def test_partitions_endpoint_over_the_wire_names_the_stuck_lease(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane, engine: Engine, clock: ManualClock
) -> None:
    """End to end: a lease's producer (another process) leaves its transaction open; two calls
    of GET /partitions see the stable offset not moving and name the lease."""
    broker, proxy = faulty
    topic = broker.create_topic(1)
    c = Coordinator(engine, plane, clock=clock, limits=Limits(max_partitions=16))
    try:
        c.register_sink(SinkSpec(name="orders", transactional_id_prefix=tid("orders-eos"), bootstrap_servers=broker.bootstrap,
                                 topics=[topic], transaction_timeout_ms=60_000), ACTOR)
        gen, _ = c.start_generation("orders", "q-1", "r-1", ACTOR)
        begun = c.begin_checkpoint("orders", 0, gen, ACTOR)
        assert begun.attempt is not None
        lease = c.begin_partition("orders", 0, begun.attempt.number, gen, 0, 1)
        stats = run_transactional_producer(broker.bootstrap, lease.transactional_id, topic, records=1)
        c.precommit("orders", lease.id, gen, PrecommitRequest(stats.producer_id, stats.producer_epoch, 1, 10))
        proxy.advertise(DESCRIBE_PRODUCERS, 0, 0)
        proxy.respond(DESCRIBE_PRODUCERS, describe_producers_answer({(topic, 0): [(stats.producer_id, stats.producer_epoch, 0)]}))

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
            assert "does not support ListTransactions" in verdicts["prefix_unused"]["verdict"]  # not advertised here
    finally:
        c.close()
