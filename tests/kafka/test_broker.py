"""The I/O-free interpretation of broker observations (coordinator/kafka/broker.py), the parsing and
verdict functions of the wire control plane fed with kafka-python response objects (no broker),
and the two admin endpoints over a record-only control plane on a real Postgres.

Why no broker here: these are the pure functions' edge cases a healthy broker does not produce on
cue (an id that expires between ListTransactions and DescribeTransactions, per-partition error
codes, leaderless partitions, epochs that do not match a lease). What the real broker answers is
tested in tests/kafka/test_broker_wire.py and tests/kafka/test_kafka_wire.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kafka.protocol.admin.configs import DescribeConfigsResponse
from kafka.protocol.admin.transactions import (
    DescribeProducersResponse,
    DescribeTransactionsResponse,
    ListTransactionsRequest,
    ListTransactionsResponse,
)
from kafka.protocol.consumer.offsets import ListOffsetsResponse
from kafka.protocol.metadata import MetadataResponse
from sqlalchemy import Engine

from coordinator.http.api import create_app
from coordinator.kafka.broker import (
    PartitionWatch,
    name_blocking_transactions,
    stuck_partitions,
)
from coordinator.service.clock import ManualClock
from coordinator.protocol.recovery_rules import lingering
from coordinator.kafka.control_plane import (
    BrokerCheck,
    ControlPlaneError,
    KafkaTarget,
    OpenTransaction,
    PartitionStability,
    RecordingControlPlane,
)
from coordinator.kafka.wire.requests import (
    OPEN_STATES,
    UnsupportedByBroker,
    authorization_message,
    list_transactions_request,
    parse_describe_producers,
    parse_describe_transactions,
    parse_list_offsets,
    parse_list_transactions,
    parse_metadata,
    parse_transaction_max_timeout,
)
from coordinator.kafka.wire.verdicts import (
    verdict_prefix,
    verdict_transaction_timeout,
    verdict_transactions_supported,
)
from coordinator.protocol.model import Lease
from coordinator.protocol.states import UNRESOLVED_LEASE_STATES, LeaseState
from coordinator.service import Coordinator, Limits, SinkSpec

ADMIN = "test-admin-token-7f3a"
SECRET = b"test-writer-token-secret"
ACTOR = "test"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ps(partition: int, hw: int, lso: int, pid: int | None = None, epoch: int | None = None, topic: str = "out") -> PartitionStability:
    return PartitionStability(topic, partition, hw, lso, pid, epoch, lso if pid is not None else None)


def lease(id_: int, tid: str, pid: int | None, epoch: int | None, state: LeaseState = LeaseState.COMMITTING) -> Lease:
    resolved = None if state in UNRESOLVED_LEASE_STATES else T0
    return Lease(id=id_, sink_id=1, checkpoint_id=1, attempt_id=1, partition=0, task_attempt_id=id_, ordinal=0,
                 transactional_id=tid, state=state, taken_at=T0, leased_at=T0, deadline_at=T0, producer_id=pid,
                 producer_epoch=epoch, records=1, bytes=1, write_ms=None, first_offsets=None, resolved_at=resolved)


def txn(tid: str, state: str = "Ongoing", pid: int = 7) -> OpenTransaction:
    return OpenTransaction(tid, pid, 0, state, 1_000, 60_000, (("out", 0),))


# --- stuck_partitions ----------------------------------------------------------------------------


def test_a_partition_whose_lso_stays_below_the_hw_is_stuck_and_names_its_producer() -> None:
    before = [ps(0, 10, 4, 42, 3), ps(1, 10, 10), ps(2, 8, 2), ps(3, 5, 1)]
    after = [ps(0, 12, 4, 42, 3), ps(1, 11, 10), ps(2, 9, 5), ps(3, 5, 5)]
    stuck = stuck_partitions(before, after, 30.0)
    assert [(s.partition, s.last_stable_offset, s.lag, s.blocking_producer_id, s.blocking_producer_epoch) for s in stuck] == [
        (0, 4, 8, 42, 3)
    ]
    assert stuck[0].stalled_for_s == 30.0 and stuck[0].blocking_txn_start_offset == 4


def test_not_stuck_without_two_observations_elapsed_time_or_a_stall_long_enough() -> None:
    before, after = [ps(0, 10, 4)], [ps(0, 10, 4)]
    assert stuck_partitions([], after, 30.0) == []  # seen once
    assert stuck_partitions(before, after, 0.0) == []  # no time passed
    assert stuck_partitions(before, after, 5.0, min_stall_s=10.0) == []
    assert len(stuck_partitions(before, after, 10.0, min_stall_s=10.0)) == 1
    # a transaction that only just started at the old stable offset is not a stall yet
    assert stuck_partitions([ps(0, 4, 4)], [ps(0, 6, 4)], 30.0) == []
    # the offset went back (topic recreated): not the same stall
    assert stuck_partitions([ps(0, 10, 6)], [ps(0, 3, 1)], 30.0) == []
    # same partition number of another topic is another partition
    assert stuck_partitions([ps(0, 10, 4, topic="a")], [ps(0, 10, 4, topic="b")], 30.0) == []


def test_partition_watch_measures_the_stall_from_when_the_lso_stopped() -> None:
    now = [100.0]
    watch = PartitionWatch(clock=lambda: now[0])
    assert watch.observe("s", [ps(0, 10, 4, 42, 0)]) == []
    now[0] = 130.0
    assert watch.observe("s", [ps(0, 11, 4, 42, 0)], min_stall_s=60) == []  # stalled 30 s only
    now[0] = 170.0
    stuck = watch.observe("s", [ps(0, 12, 4, 42, 0)], min_stall_s=60)
    assert [(s.partition, s.stalled_for_s) for s in stuck] == [(0, 70.0)]  # measured from t=100, not t=130
    now[0] = 180.0
    assert watch.observe("s", [ps(0, 12, 12)]) == []  # caught up
    now[0] = 190.0
    assert watch.observe("s", [ps(0, 14, 12)]) == []  # a new transaction at 12: the clock restarts
    assert watch.observe("other", [ps(0, 14, 12)]) == []  # sinks are watched separately
    watch.forget("s")
    now[0] = 400.0
    assert watch.observe("s", [ps(0, 14, 12)]) == []


# --- name_blocking_transactions ------------------------------------------------------------------


def test_blocking_producer_is_mapped_to_the_lease_with_its_producer_id_and_epoch() -> None:
    stuck = stuck_partitions([ps(0, 10, 4, 42, 3), ps(1, 9, 2, 99, 0), ps(2, 9, 2)],
                             [ps(0, 10, 4, 42, 3), ps(1, 9, 2, 99, 0), ps(2, 9, 2)], 60.0)
    leases = [
        lease(1, "orders-tx-0", 42, 2, LeaseState.ABORTED),  # the same pooled id, an older epoch
        lease(2, "orders-tx-0", 42, 3, LeaseState.COMMITTING),
        lease(3, "orders-tx-1", None, None, LeaseState.LEASED),
    ]
    named = name_blocking_transactions(stuck, leases, [txn("someone-else-5", pid=99)])
    assert [(b.partition, b.transactional_id, b.lease_id, b.lease_state, b.known) for b in named] == [
        (0, "orders-tx-0", 2, "COMMITTING", True),
        (1, "someone-else-5", None, None, False),
        (2, None, None, None, False),
    ]
    assert "orders-tx-0 (lease 2, COMMITTING, producer id 42 epoch 3)" in named[0].explanation
    assert "no lease for" in named[1].explanation
    assert "did not name" in named[2].explanation


def test_without_an_exact_epoch_an_unresolved_lease_of_the_producer_id_wins() -> None:
    stuck = stuck_partitions([ps(0, 10, 4, 42, 9)], [ps(0, 10, 4, 42, 9)], 60.0)
    leases = [lease(5, "p-0", 42, 1, LeaseState.LEASED), lease(7, "p-0", 42, 2, LeaseState.COMMITTED)]
    (named,) = name_blocking_transactions(stuck, leases)
    assert (named.lease_id, named.known) == (5, True)
    (unknown,) = name_blocking_transactions(stuck, [])
    assert (unknown.transactional_id, unknown.lease_id, unknown.known, unknown.producer_id) == (None, None, False, 42)


def test_a_lease_whose_record_has_not_come_is_named_through_the_brokers_listing() -> None:
    """A try's producer id reaches the coordinator only with the commit: until then the broker's
    listing (producer id -> transactional id) names the lease holding the id."""
    stuck = stuck_partitions([ps(0, 10, 4, 42, 0)], [ps(0, 10, 4, 42, 0)], 60.0)
    held = lease(9, "orders-tx-3", None, None, LeaseState.LEASED)
    (named,) = name_blocking_transactions(stuck, [held], [txn("orders-tx-3", pid=42)])
    assert (named.transactional_id, named.lease_id, named.lease_state, named.known) == ("orders-tx-3", 9, "LEASED", True)
    ended = lease(9, "orders-tx-3", None, None, LeaseState.ABORTED)  # the id was freed since: not its lease
    (unknown,) = name_blocking_transactions(stuck, [ended], [txn("orders-tx-3", pid=42)])
    assert (unknown.transactional_id, unknown.lease_id, unknown.known) == ("orders-tx-3", None, False)


# --- lingering --------------------------------------------------------------------------------


def test_lingering_is_what_no_unresolved_lease_explains() -> None:
    open_ = [txn("p-3"), txn("p-1"), txn("p-2", "PrepareCommit"), txn("p-4", "PrepareAbort"), txn("p-5", "PrepareEpochFence")]
    held = [lease(1, "p-1", 7, 0)]
    assert [t.transactional_id for t in lingering(open_, held)] == ["p-3"]
    assert [t.transactional_id for t in lingering(open_, held, include_completing=True)] == ["p-3", "p-2", "p-4", "p-5"]
    assert lingering(open_, [*held, lease(3, "p-3", 7, 0, LeaseState.ABORTING)]) == []
    assert [t.transactional_id for t in lingering(open_, [lease(3, "p-3", 7, 0, LeaseState.ABORTED)])] == ["p-3", "p-1"]
    assert lingering([], held) == []


# --- parsing kafka-python response objects -------------------------------------------------------


def test_list_and_describe_transactions_are_parsed_and_filtered() -> None:
    listing = ListTransactionsResponse(version=1, throttle_time_ms=0, error_code=0, unknown_state_filters=[], transaction_states=[
        ListTransactionsResponse.TransactionState(transactional_id=t, producer_id=i, transaction_state="Ongoing")
        for i, t in enumerate(["pfx-2", "other-1", "pfx-1", "pf"])
    ])
    assert parse_list_transactions(listing, "pfx-") == [("pfx-1", 2, "Ongoing"), ("pfx-2", 0, "Ongoing")]
    refused = replace_error(listing, 31)
    with pytest.raises(ControlPlaneError) as exc:
        parse_list_transactions(refused, "pfx-")
    assert (exc.value.code, exc.value.retriable) == ("cluster_authorization_failed", False)

    state = DescribeTransactionsResponse.TransactionState
    topic = state.TopicData
    described = DescribeTransactionsResponse(version=0, throttle_time_ms=0, transaction_states=[
        state(error_code=0, transactional_id="pfx-1", transaction_state="Ongoing", transaction_timeout_ms=60_000,
              transaction_start_time_ms=1_700_000_000_000, producer_id=5, producer_epoch=2,
              topics=[topic(topic="out", partitions=[1, 0]), topic(topic="b", partitions=[3])]),
        state(error_code=0, transactional_id="pfx-2", transaction_state="CompleteCommit", transaction_timeout_ms=60_000,
              transaction_start_time_ms=-1, producer_id=6, producer_epoch=0, topics=[]),
        state(error_code=105, transactional_id="pfx-3", transaction_state="", transaction_timeout_ms=-1,
              transaction_start_time_ms=-1, producer_id=-1, producer_epoch=-1, topics=[]),
        state(error_code=0, transactional_id="pfx-4", transaction_state="PrepareAbort", transaction_timeout_ms=-1,
              transaction_start_time_ms=-1, producer_id=8, producer_epoch=1, topics=[]),
    ])
    assert parse_describe_transactions(described) == [
        OpenTransaction("pfx-1", 5, 2, "Ongoing", 1_700_000_000_000, 60_000, (("b", 3), ("out", 0), ("out", 1))),
        OpenTransaction("pfx-4", 8, 1, "PrepareAbort", None, None, ()),
    ]
    described.transaction_states[0].error_code = 16  # NOT_COORDINATOR: the id moved, list again
    with pytest.raises(Exception) as moved:
        parse_describe_transactions(described)
    assert not isinstance(moved.value, ControlPlaneError)  # retried inside the control plane


def replace_error(response: Any, code: int) -> Any:
    response.error_code = code
    return response


def test_list_transactions_request_filters_states_and_uses_the_v2_pattern_when_offered() -> None:
    old = list_transactions_request(OPEN_STATES, "pfx-", version=1)
    assert old.state_filters == list(OPEN_STATES) and old.transactional_id_pattern is None
    new = list_transactions_request((), "a.b-", version=2)
    assert new.state_filters == [] and new.transactional_id_pattern == "\\Qa.b-\\E.*"
    encoded = bytes(new.encode(version=2))
    assert ListTransactionsRequest.decode(encoded, version=2).transactional_id_pattern == "\\Qa.b-\\E.*"


def test_describe_producers_names_the_earliest_open_transaction() -> None:
    producer = DescribeProducersResponse.TopicResponse.PartitionResponse.ProducerState
    partition = DescribeProducersResponse.TopicResponse.PartitionResponse

    def p(pid: int, epoch: int, start: int) -> Any:
        return producer(producer_id=pid, producer_epoch=epoch, last_sequence=0, last_timestamp=0, coordinator_epoch=0,
                        current_txn_start_offset=start)

    response = DescribeProducersResponse(version=0, throttle_time_ms=0, topics=[DescribeProducersResponse.TopicResponse(
        name="out", partitions=[
            partition(partition_index=0, error_code=0, error_message=None,
                      active_producers=[p(1, 0, -1), p(9, 4, 120), p(3, 2, 100), p(4, 0, 150)]),
            partition(partition_index=1, error_code=0, error_message=None, active_producers=[p(1, 0, -1)]),
            partition(partition_index=2, error_code=29, error_message="no", active_producers=[]),
        ])])
    blocking, errors = parse_describe_producers(response)
    assert blocking == {("out", 0): (3, 2, 100)}  # idempotent producer (-1) and later transactions ignored
    assert errors == {("out", 2): "topic_authorization_failed"}


def test_offsets_metadata_and_configs_are_parsed() -> None:
    topic, part = ListOffsetsResponse.ListOffsetsTopicResponse, ListOffsetsResponse.ListOffsetsTopicResponse.ListOffsetsPartitionResponse
    offsets = ListOffsetsResponse(version=4, throttle_time_ms=0, topics=[topic(name="out", partitions=[
        part(partition_index=0, error_code=0, timestamp=-1, offset=17, leader_epoch=0),
        part(partition_index=1, error_code=0, timestamp=-1, offset=3, leader_epoch=0)])])
    assert parse_list_offsets(offsets) == {("out", 0): 17, ("out", 1): 3}

    mt, mp = MetadataResponse.MetadataResponseTopic, MetadataResponse.MetadataResponseTopic.MetadataResponsePartition

    def metadata(error: int, leader: int) -> Any:
        return MetadataResponse(version=9, throttle_time_ms=0, brokers=[], cluster_id="c", controller_id=1, topics=[
            mt(error_code=error, name="out", is_internal=False, partitions=[
                mp(error_code=0, partition_index=1, leader_id=leader, leader_epoch=0, replica_nodes=[1], isr_nodes=[1],
                   offline_replicas=[]),
                mp(error_code=0, partition_index=0, leader_id=2, leader_epoch=0, replica_nodes=[2], isr_nodes=[2],
                   offline_replicas=[])])])

    assert parse_metadata(metadata(0, 1), ["out"]) == {"out": [(0, 2), (1, 1)]}
    with pytest.raises(ControlPlaneError) as missing:
        parse_metadata(metadata(3, 1), ["out"])
    assert missing.value.code == "unknown_topic_or_partition" and "'out' does not exist" in str(missing.value)
    with pytest.raises(Exception) as leaderless:
        parse_metadata(metadata(0, -1), ["out"])
    assert "has no leader" in str(leaderless.value) and not isinstance(leaderless.value, ControlPlaneError)

    result = DescribeConfigsResponse.DescribeConfigsResult
    config = result.DescribeConfigsResourceResult

    def configs(error: int, entries: dict[str, str | None]) -> Any:
        return DescribeConfigsResponse(version=1, throttle_time_ms=0, results=[result(
            error_code=error, error_message=None, resource_type=4, resource_name="1",
            configs=[config(name=k, value=v, read_only=True, is_default=False, config_source=5, is_sensitive=False,
                            synonyms=[]) for k, v in entries.items()])])

    assert parse_transaction_max_timeout(configs(0, {"log.retention.ms": "1", "transaction.max.timeout.ms": "3600000"})) == 3_600_000
    assert parse_transaction_max_timeout(configs(0, {})) is None  # a broker that does not report it
    with pytest.raises(ControlPlaneError) as denied:
        parse_transaction_max_timeout(configs(31, {}))
    assert denied.value.code == "cluster_authorization_failed"


# --- verdicts ----------------------------------------------------------------------------------


def test_verdicts_in_plain_words() -> None:
    full = {22: (0, 5), 24: (0, 5), 26: (0, 4)}
    assert verdict_transactions_supported(full).ok
    missing = verdict_transactions_supported({22: (0, 5)})
    assert not missing.ok and "AddPartitionsToTxn, EndTxn" in missing.verdict and missing.fix

    over = verdict_transaction_timeout(900_000, 3_600_000)
    assert not over.ok and "3600000 exceeds the broker's transaction.max.timeout.ms 900000" in over.verdict
    assert "INVALID_TRANSACTION_TIMEOUT" in over.verdict and "at least 3600000" in (over.fix or "")
    assert verdict_transaction_timeout(900_000, 900_000).ok
    unknown = verdict_transaction_timeout(None, 60_000)
    assert unknown.ok and "did not report" in unknown.verdict and "not verified" in unknown.verdict
    assert not verdict_transaction_timeout(None, 1_000_000).ok

    listed = [("pfx-0", 1, "Empty"), ("pfx-9", 2, "Ongoing"), ("pfx-7", 3, "CompleteCommit")]
    clash = verdict_prefix(listed, "pfx-", {"pfx-0"})
    assert not clash.ok
    assert "already in use by producers the coordinator does not know: pfx-7 (producer id 3, CompleteCommit), pfx-9" in clash.verdict
    assert "pfx-0" not in clash.verdict
    assert verdict_prefix(listed, "pfx-", {"pfx-0", "pfx-7", "pfx-9"}).ok

    msg = authorization_message(32, "cluster_authorization_failed")
    assert msg.startswith("not authorized") and "lacks DescribeConfigs on the cluster" in msg
    msg = authorization_message(66, "transactional_id_authorization_failed", "pfx-")
    assert "lacks Describe on the transactional ids under prefix 'pfx-'" in msg
    unsupported = UnsupportedByBroker(66)
    assert str(unsupported) == ("broker does not support ListTransactions (KIP-664, Kafka >= 3.0): "
                                "lingering-transaction sweep unavailable")
    assert (unsupported.code, unsupported.retriable) == ("unsupported_by_broker", False)


# --- the admin endpoints (record-only control plane, real Postgres) ------------------------------


class CheckingPlane(RecordingControlPlane):
    def __init__(self) -> None:
        super().__init__()
        self.checked: list[tuple[KafkaTarget, str, set[str]]] = []

    def check_broker(self, target: KafkaTarget, prefix: str, known_ids: set[str]) -> list[BrokerCheck]:
        self.checked.append((target, prefix, known_ids))
        return [BrokerCheck("bootstrap", True, "ok"), BrokerCheck("prefix_unused", False, "in use", fix="change it")]


@pytest.fixture
def plane() -> CheckingPlane:
    return CheckingPlane()


@pytest.fixture
def coord(engine: Engine, plane: CheckingPlane, clock: ManualClock) -> Iterator[Coordinator]:
    c = Coordinator(engine, plane, clock=clock, limits=Limits(max_partitions=64))
    yield c
    c.close()


def auth(token: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def leased_sink(c: Coordinator, *, pid: int = 42, epoch: int = 3) -> Lease:
    c.register_sink(SinkSpec(name="orders", transactional_id_prefix="orders-tx", bootstrap_servers="k:9092",
                             topics=["out"], transaction_timeout_ms=60_000), ACTOR, check_broker=False)
    gen, _ = c.start_generation("orders", "q-1", "r-1", ACTOR)
    begun = c.begin_checkpoint("orders", 0, gen, ACTOR)
    assert begun.attempt is not None
    lease_ = c.begin_partition("orders", 0, begun.attempt.number, gen, 0, 11)
    # its producer's transaction is open on the broker (its record has not come with a commit yet)
    c.control_plane.open_transactions.append(txn(lease_.transactional_id, pid=pid))  # type: ignore[union-attr]
    return lease_


def test_broker_check_endpoint_passes_the_sinks_pool_ids(coord: Coordinator, plane: CheckingPlane) -> None:
    lease_ = leased_sink(coord)
    with TestClient(create_app(coord, admin_token=ADMIN, token_secret=SECRET)) as http:
        resp = http.post("/v1/sinks/orders/broker-check", headers=auth())
        assert resp.status_code == 200, resp.text
        assert resp.json() == [
            {"name": "bootstrap", "ok": True, "verdict": "ok", "fix": None, "verified": True},
            {"name": "prefix_unused", "ok": False, "verdict": "in use", "fix": "change it", "verified": True},
        ]
        (target, prefix, known), = plane.checked
        assert (target.sink_name, target.bootstrap_servers, target.transaction_timeout_ms) == ("orders", "k:9092", 60_000)
        assert prefix == "orders-tx-" and known == {lease_.transactional_id}
        assert http.post("/v1/sinks/orders/broker-check", headers=auth("wt_nope")).status_code == 403
        assert http.post("/v1/sinks/nope/broker-check", headers=auth()).status_code == 404


def test_partitions_endpoint_flags_a_stall_and_names_the_lease(coord: Coordinator, plane: CheckingPlane) -> None:
    lease_ = leased_sink(coord, pid=42, epoch=3)
    plane.partitions = [ps(0, 10, 4, 42, 3), ps(1, 7, 7), PartitionStability("elsewhere", 0, 9, 1)]
    with TestClient(create_app(coord, admin_token=ADMIN, token_secret=SECRET)) as http:
        first = http.get("/v1/sinks/orders/partitions", params={"min_stall_s": 0}, headers=auth())
        assert first.status_code == 200, first.text
        rows = first.json()["partitions"]
        assert [(r["partition"], r["lag"], r["stuck"]) for r in rows] == [(0, 6, False), (1, 0, False)]  # only its topics
        assert rows[0]["blocking_producer_id"] == 42 and rows[0]["blocking_transaction"] is None

        second = http.get("/v1/sinks/orders/partitions", params={"min_stall_s": 0}, headers=auth()).json()
        p0, p1 = second["partitions"]
        assert p0["stuck"] is True and p0["stalled_for_s"] > 0 and p1["stuck"] is False
        blocking = p0["blocking_transaction"]
        assert (blocking["transactional_id"], blocking["lease_id"], blocking["known"]) == (lease_.transactional_id, lease_.id, True)
        assert blocking["lease_state"] == "LEASED" and second["notes"] == []

        # the default threshold (60 s) is not reached between two quick calls
        assert http.get("/v1/sinks/orders/partitions", headers=auth()).json()["partitions"][0]["stuck"] is False

        plane.partitions = [ps(0, 10, 4), ps(1, 7, 7)]  # the broker does not name the producer
        unnamed = http.get("/v1/sinks/orders/partitions", params={"min_stall_s": 0}, headers=auth()).json()
        assert unnamed["partitions"][0]["blocking_transaction"]["known"] is False
        assert "DescribeProducers" in unnamed["notes"][0]

        plane.fail_next(ControlPlaneError("cannot bootstrap", retriable=True, code="broker_unreachable"))
        down = http.get("/v1/sinks/orders/partitions", headers=auth())
        assert down.status_code == 503 and down.json()["error"]["reason"] == "kafka_unavailable"
        assert "cannot bootstrap" in down.json()["error"]["message"]


def test_endpoints_answer_503_without_a_control_plane(engine: Engine, clock: ManualClock) -> None:
    c = Coordinator(engine, None, clock=clock)
    try:
        c.register_sink(SinkSpec(name="orders", transactional_id_prefix="orders-tx", bootstrap_servers="k:9092",
                                 topics=["out"]), ACTOR)
        with TestClient(create_app(c, admin_token=ADMIN, token_secret=SECRET)) as http:
            for resp in (http.post("/v1/sinks/orders/broker-check", headers=auth()),
                         http.get("/v1/sinks/orders/partitions", headers=auth())):
                assert resp.status_code == 503, resp.text
                assert resp.json()["error"]["reason"] == "kafka_control_plane_unconfigured"
            assert http.get("/v1/sinks/nope/partitions", headers=auth()).status_code == 404
            paths = http.get("/openapi.json").json()["paths"]
            assert "post" in paths["/v1/sinks/{name}/broker-check"] and "get" in paths["/v1/sinks/{name}/partitions"]
    finally:
        c.close()

