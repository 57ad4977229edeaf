"""Wire-level tests of the Kafka control plane (`KafkaWireControlPlane`) against the Tansu broker.

READ THIS FIRST: Tansu, like librdkafka's mock cluster, delivers aborted and still-open
transactional records to `read_committed` consumers. These tests therefore prove the control
plane's wire behaviour -- FindCoordinator + EndTxn accepted or refused, InitProducerId fencing,
producer ids and epochs, retries and error classification -- and NOT exactly-once visibility.
Exactly-once visibility is the job of the fault-injection simulation and of the real-Kafka e2e
suite (DESIGN.md §5).

What Tansu 0.6.0 (memory storage) was observed to answer, and the tests pin:
- EndTxn(commit) from a process that never produced, with the stored id/pid/epoch: NONE.
- The same EndTxn(commit) repeated after it completed: NONE (Kafka under transaction version 1
  answers the same). Tansu also answers NONE to EndTxn(abort) after a commit, where Kafka says
  INVALID_TXN_STATE.
- A refused EndTxn (stale or newer epoch, wrong producer id, unknown transactional id, nothing to
  commit): Tansu sends NO error code; it closes the connection, and its log names the refusal
  (`Api(ProducerFenced)`, `Api(UnknownProducerId)`, `Api(TransactionalIdNotFound)`). On the wire
  this is indistinguishable from a network failure, so the control plane reports it as retriable
  after its bounded budget; it never reports success. The non-retriable classification of Kafka's
  error codes (PRODUCER_FENCED etc.) is exercised through `KafkaFaultProxy`, which answers with
  the real Kafka error code in front of a live Tansu.
- InitProducerId on an id with an open transaction: NONE at once with epoch + 1 (Kafka first
  answers CONCURRENT_TRANSACTIONS while it aborts; that path is exercised through the proxy). The
  fenced producer's next Produce is refused with a real PRODUCER_FENCED error code.
- Tansu writes real transaction markers: a COMMIT control batch after EndTxn(commit), an ABORT
  control batch after the InitProducerId that fenced an open transaction, and none while a
  transaction is open (Fetch then reports a last stable offset below the high watermark). The
  tests read them with a raw Fetch (`partition_log`) as the broker's record of how each
  transaction ended -- which is what Tansu's read_committed consumers ignore.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import Engine

from coordinator.clock import ManualClock
from coordinator.kafka_control import ControlPlaneError, KafkaTarget, PreparedTransaction, build_control_plane
from coordinator.kafka_wire import KafkaWireControlPlane
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import PartitionResult
from coordinator.protocol.rules import BeginAction, PrecommitRequest
from coordinator.protocol.states import CheckpointState, LeaseState
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.settings import Settings
from kafka_broker import (  # noqa: F401 - fixtures
    faulty,
    API_END_TXN,
    API_FIND_COORDINATOR,
    API_INIT_PRODUCER_ID,
    KafkaFaultProxy,
    ProducerProcess,
    TansuBroker,
    free_port,
    partition_log,
    proxied,
    run_transactional_producer,
    run_transactional_producers,
    tansu,
)

REQUEST_TIMEOUT_MS = 1_000
BUDGET_MS = 2_500
SHORT_BUDGET_MS = 700  # for calls Tansu refuses by closing the connection: they use the whole budget
ACTOR = "test"


def tid(name: str = "tx") -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def target(bootstrap: str) -> KafkaTarget:
    return KafkaTarget("orders", bootstrap, 60_000)


def prepared(stats: Any, *, epoch: int | None = None, pid: int | None = None) -> PreparedTransaction:
    return PreparedTransaction(
        stats.transactional_id,
        stats.producer_id if pid is None else pid,
        stats.producer_epoch if epoch is None else epoch,
    )


def is_open(bootstrap: str, topic: str, partition: int) -> bool:
    return partition_log(bootstrap, topic, partition).has_open_transaction


def markers(bootstrap: str, topic: str, partition: int, producer_id: int) -> list[str]:
    return partition_log(bootstrap, topic, partition).markers(producer_id)


@pytest.fixture
def plane() -> Iterator[KafkaWireControlPlane]:
    p = KafkaWireControlPlane(request_timeout_ms=REQUEST_TIMEOUT_MS, retry_budget_ms=BUDGET_MS,
                              retry_backoff_ms=40, retry_backoff_max_ms=300)
    yield p
    p.close()


@pytest.fixture
def short_plane() -> Iterator[KafkaWireControlPlane]:
    p = KafkaWireControlPlane(request_timeout_ms=400, retry_budget_ms=SHORT_BUDGET_MS,
                              retry_backoff_ms=40, retry_backoff_max_ms=200)
    yield p
    p.close()


def refused_by_tansu(broker: TansuBroker, call: Callable[[], None], reason: str) -> ControlPlaneError:
    """Tansu refuses by closing the connection (its log names why): the control plane must not
    report success, and gives up as retriable within its bounded budget."""
    mark = broker.log_size()
    started = time.monotonic()
    with pytest.raises(ControlPlaneError) as exc:
        call()
    elapsed = time.monotonic() - started
    assert exc.value.retriable is True, exc.value
    assert exc.value.code == "network_exception", exc.value
    assert elapsed < (SHORT_BUDGET_MS + 400) / 1000 + 2.0, elapsed  # budget + one request, slack for load
    log = broker.log_since(mark)
    assert f"Api({reason})" in log, log[-2000:]
    return exc.value


# --- (a) resume-commit from another process ----------------------------------------------------


def test_resume_commit_from_another_process(tansu: TansuBroker, plane: KafkaWireControlPlane) -> None:
    topic = tansu.create_topic(1)
    stats = run_transactional_producer(tansu.bootstrap, tid(), topic, records=5)  # exits, no commit
    assert stats.producer_id >= 0 and stats.producer_epoch >= 0
    before = partition_log(tansu.bootstrap, topic, 0)
    assert before.has_open_transaction, "the producer's transaction should still be open"
    assert before.data_batches(stats.producer_id) >= 1 and before.markers(stats.producer_id) == []
    mark = tansu.log_size()

    plane.commit(target(tansu.bootstrap), prepared(stats))

    after = partition_log(tansu.bootstrap, topic, 0)
    assert after.markers(stats.producer_id) == ["commit"], after.batches
    assert not after.has_open_transaction
    assert "ERROR" not in tansu.log_since(mark)


# --- (b) a retried commit is success -------------------------------------------------------------


def test_retried_commit_of_a_completed_transaction_is_success(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    broker, proxy = faulty
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    plane.commit(target(broker.bootstrap), prepared(stats))
    assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["commit"]

    proxy.clear()
    plane.commit(target(broker.bootstrap), prepared(stats))  # a second finisher, same pid and epoch
    # Tansu answered the repeated EndTxn with NONE at once: exactly one request, no retry, and
    # no second marker
    assert proxy.requests[API_END_TXN] == 1
    assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["commit"]


def test_commit_whose_answer_was_lost_is_retried_to_success(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    """The broker applies EndTxn but the connection dies before its answer arrives: the retry of
    the same commit (same epoch) is answered NONE, so the call succeeds."""
    broker, proxy = faulty
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    proxy.inject(API_END_TXN, action="drop")

    plane.commit(target(broker.bootstrap), prepared(stats))

    assert proxy.injected[API_END_TXN] == 1
    assert proxy.requests[API_END_TXN] == 2  # the applied one whose answer was lost, and the retry
    assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["commit"]


# --- (c) abort by re-initialising the id --------------------------------------------------------


def test_abort_fences_the_producer_and_the_old_epoch_can_no_longer_commit(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane, short_plane: KafkaWireControlPlane
) -> None:
    broker, proxy = faulty
    topic = broker.create_topic(1)
    producer = ProducerProcess(broker.bootstrap, tid(), topic, stay=True)
    try:
        stats = producer.wait_ready()
        assert is_open(broker.bootstrap, topic, 0)
        proxy.clear()

        plane.abort(target(broker.bootstrap), stats.transactional_id)

        assert proxy.requests[API_INIT_PRODUCER_ID] == 1  # Tansu: NONE at once, no CONCURRENT_TRANSACTIONS
        assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["abort"]
        assert not is_open(broker.bootstrap, topic, 0)
        # the still-running producer holds the old epoch: the broker refuses it with a real error code
        assert producer.produce_more() == ["PRODUCER_FENCED"]
        # a resume-commit with the old epoch is refused (Tansu: connection closed, log names it)
        refused_by_tansu(broker, lambda: short_plane.commit(target(broker.bootstrap), prepared(stats)),
                         "ProducerFenced")
        assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["abort"]  # no commit slipped in
    finally:
        producer.close()


def test_abort_of_an_id_nobody_used_is_harmless(tansu: TansuBroker, plane: KafkaWireControlPlane) -> None:
    plane.abort(target(tansu.bootstrap), tid("never-used"))  # initialises it; nothing to abort
    plane.abort(target(tansu.bootstrap), tid("never-used"))


def test_abort_retries_while_kafka_answers_concurrent_transactions(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    """Kafka answers CONCURRENT_TRANSACTIONS to InitProducerId while it aborts the open
    transaction; the abort repeats the request until the broker answers NONE."""
    broker, proxy = faulty
    topic = broker.create_topic(1)
    producer = ProducerProcess(broker.bootstrap, tid(), topic, stay=True)
    try:
        stats = producer.wait_ready()
        proxy.clear()
        proxy.inject(API_INIT_PRODUCER_ID, error_code=51, times=2)  # CONCURRENT_TRANSACTIONS

        plane.abort(target(broker.bootstrap), stats.transactional_id)

        assert proxy.injected[API_INIT_PRODUCER_ID] == 2
        assert proxy.requests[API_INIT_PRODUCER_ID] == 3
        assert producer.produce_more() == ["PRODUCER_FENCED"]
        assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["abort"]
    finally:
        producer.close()


# --- (d) stale epochs are fenced -------------------------------------------------------------


def test_stale_epoch_is_refused_and_the_current_one_commits(
    tansu: TansuBroker, plane: KafkaWireControlPlane, short_plane: KafkaWireControlPlane
) -> None:
    topic = tansu.create_topic(1)
    name = tid()
    first = run_transactional_producer(tansu.bootstrap, name, topic)
    second = run_transactional_producer(tansu.bootstrap, name, topic)  # initialising again fences the first
    assert second.producer_id == first.producer_id
    assert second.producer_epoch == first.producer_epoch + 1
    # the second init_transactions aborted the first producer's open transaction
    assert markers(tansu.bootstrap, topic, 0, first.producer_id) == ["abort"]
    tg = target(tansu.bootstrap)

    refused_by_tansu(tansu, lambda: short_plane.commit(tg, prepared(first)), "ProducerFenced")
    refused_by_tansu(tansu, lambda: short_plane.commit(tg, prepared(second, epoch=second.producer_epoch - 1)),
                     "ProducerFenced")
    refused_by_tansu(tansu, lambda: short_plane.commit(tg, prepared(second, epoch=second.producer_epoch + 1)),
                     "ProducerFenced")
    log = partition_log(tansu.bootstrap, topic, 0)
    assert log.has_open_transaction and log.markers(second.producer_id) == ["abort"], "a refused commit ended it"

    plane.commit(tg, prepared(second))
    assert markers(tansu.bootstrap, topic, 0, second.producer_id) == ["abort", "commit"]


# --- (e) error classification --------------------------------------------------------------------


def test_wrong_or_unknown_producer_is_refused_and_commits_nothing(
    tansu: TansuBroker, plane: KafkaWireControlPlane, short_plane: KafkaWireControlPlane
) -> None:
    topic = tansu.create_topic(1)
    stats = run_transactional_producer(tansu.bootstrap, tid(), topic)
    tg = target(tansu.bootstrap)

    refused_by_tansu(tansu, lambda: short_plane.commit(tg, prepared(stats, pid=stats.producer_id + 1000)),
                     "UnknownProducerId")
    refused_by_tansu(tansu, lambda: short_plane.commit(tg, PreparedTransaction(tid("unknown"), stats.producer_id, 0)),
                     "TransactionalIdNotFound")
    assert is_open(tansu.bootstrap, topic, 0)

    with pytest.raises(ControlPlaneError) as exc:  # never assigned: refused before any request
        plane.commit(tg, prepared(stats, pid=-1))
    assert exc.value.retriable is False

    plane.commit(tg, prepared(stats))
    assert markers(tansu.bootstrap, topic, 0, stats.producer_id) == ["commit"]


@pytest.mark.parametrize(
    ("error_code", "code"),
    [
        (90, "producer_fenced"),
        (47, "invalid_producer_epoch"),
        (48, "invalid_txn_state"),
        (49, "invalid_producer_id_mapping"),
        (59, "unknown_producer_id"),
        (53, "transactional_id_authorization_failed"),
        (120, "transaction_abortable"),
        (-1, "unknown_server_error"),  # not known to be transient
        (12345, "kafka_error_12345"),  # a code this kafka-python does not know
    ],
)
def test_kafka_refusals_are_not_retried(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane, error_code: int, code: str
) -> None:
    broker, proxy = faulty
    proxy.inject(API_END_TXN, error_code=error_code, times=100)
    started = time.monotonic()

    with pytest.raises(ControlPlaneError) as exc:
        plane.commit(target(broker.bootstrap), PreparedTransaction(tid(), 1, 0))

    assert exc.value.retriable is False
    assert exc.value.code == code
    assert proxy.requests[API_END_TXN] == 1  # answered once, not retried
    assert time.monotonic() - started < BUDGET_MS / 1000  # no waiting out the retry budget


@pytest.mark.parametrize(("error_code", "code"), [(53, "transactional_id_authorization_failed"),
                                                  (50, "invalid_transaction_timeout")])
def test_abort_refusals_are_not_retried(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane, error_code: int, code: str
) -> None:
    broker, proxy = faulty
    proxy.inject(API_INIT_PRODUCER_ID, error_code=error_code, times=100)
    with pytest.raises(ControlPlaneError) as exc:
        plane.abort(target(broker.bootstrap), tid())
    assert (exc.value.retriable, exc.value.code) == (False, code)
    assert proxy.requests[API_INIT_PRODUCER_ID] == 1


@pytest.mark.parametrize(
    ("api_key", "error_code", "times", "refinds"),
    [
        (API_END_TXN, 51, 3, 0),  # CONCURRENT_TRANSACTIONS (e.g. PrepareCommit still completing)
        (API_END_TXN, 14, 2, 0),  # COORDINATOR_LOAD_IN_PROGRESS
        (API_END_TXN, 16, 1, 1),  # NOT_COORDINATOR: find the coordinator again
        (API_END_TXN, 15, 2, 2),  # COORDINATOR_NOT_AVAILABLE: find it again
        (API_END_TXN, 7, 1, 0),  # REQUEST_TIMED_OUT
        (API_FIND_COORDINATOR, 15, 2, 2),
    ],
)
def test_transient_answers_are_retried_until_the_commit_succeeds(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane,
    api_key: int, error_code: int, times: int, refinds: int,
) -> None:
    broker, proxy = faulty
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    proxy.clear()
    proxy.inject(api_key, error_code=error_code, times=times)

    plane.commit(target(broker.bootstrap), prepared(stats))

    assert proxy.injected[api_key] == times
    assert proxy.requests[API_FIND_COORDINATOR] == 1 + refinds
    assert proxy.requests[API_END_TXN] == 1 + (times if api_key == API_END_TXN else 0)
    assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["commit"]


def test_transient_answers_forever_give_up_as_retriable_in_bounded_time(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    broker, proxy = faulty
    proxy.inject(API_END_TXN, error_code=51, times=10_000)
    started = time.monotonic()
    with pytest.raises(ControlPlaneError) as exc:
        plane.commit(target(broker.bootstrap), PreparedTransaction(tid(), 1, 0))
    elapsed = time.monotonic() - started
    assert (exc.value.retriable, exc.value.code) == (True, "concurrent_transactions")
    assert BUDGET_MS / 1000 * 0.5 < elapsed < (BUDGET_MS + REQUEST_TIMEOUT_MS) / 1000 + 1.5
    assert proxy.requests[API_END_TXN] >= 4  # retried with backoff, not hammered
    assert proxy.requests[API_END_TXN] <= 40


def test_unreachable_bootstrap_is_retriable_after_bounded_time() -> None:
    closed = free_port()  # nothing listens there
    p = KafkaWireControlPlane(request_timeout_ms=300, retry_budget_ms=900, retry_backoff_ms=50)
    try:
        for call in (lambda: p.commit(target(f"127.0.0.1:{closed}"), PreparedTransaction("x", 1, 0)),
                     lambda: p.abort(target(f"127.0.0.1:{closed}"), "x")):
            started = time.monotonic()
            with pytest.raises(ControlPlaneError) as exc:
                call()
            assert (exc.value.retriable, exc.value.code) == (True, "broker_unreachable")
            assert time.monotonic() - started < 0.9 + 0.3 + 1.5  # budget + one request, slack for load
    finally:
        p.close()
    with pytest.raises(ControlPlaneError) as after_close:
        p.commit(target(f"127.0.0.1:{closed}"), PreparedTransaction("x", 1, 0))
    assert (after_close.value.retriable, after_close.value.code) == (True, "closed")


# --- (f) parallel commits ----------------------------------------------------------------------


def test_parallel_commits_and_aborts_share_one_connection_per_bootstrap(
    faulty: tuple[TansuBroker, KafkaFaultProxy], plane: KafkaWireControlPlane
) -> None:
    broker, proxy = faulty
    topic = broker.create_topic(6)
    stats = run_transactional_producers(broker.bootstrap, [(tid(f"p{i}"), topic, i) for i in range(6)])
    assert all(is_open(broker.bootstrap, topic, i) for i in range(6))
    proxy.clear()
    tg = target(broker.bootstrap)

    def finish(i: int) -> None:
        if i < 4:
            plane.commit(tg, prepared(stats[i]))
        else:
            plane.abort(tg, stats[i].transactional_id)

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(finish, range(6)))

    assert proxy.requests[API_END_TXN] == 4
    assert proxy.requests[API_INIT_PRODUCER_ID] == 2
    assert proxy.connections <= 3, proxy.connections  # bootstrap + coordinator, shared by the threads
    ended = [markers(broker.bootstrap, topic, i, stats[i].producer_id) for i in range(6)]
    assert ended == [["commit"]] * 4 + [["abort"]] * 2


# --- wiring ------------------------------------------------------------------------------------


def test_build_control_plane_and_settings_accept_kafka(monkeypatch: pytest.MonkeyPatch) -> None:
    plane = build_control_plane("kafka")
    try:
        assert isinstance(plane, KafkaWireControlPlane) and plane.name == "kafka"
    finally:
        plane.close()  # type: ignore[union-attr]
    monkeypatch.setenv("COORDINATOR_KAFKA_CONTROL_PLANE", "kafka")
    assert Settings().kafka_control_plane == "kafka"
    with pytest.raises(ValueError, match="unknown or reserved"):
        KafkaWireControlPlane(client_config={"sasl_plain_pasword": "typo"})
    KafkaWireControlPlane(client_config={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}).close()
    monkeypatch.setenv("COORDINATOR_KAFKA_CLIENT_CONFIG", '{"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}')
    monkeypatch.setenv("COORDINATOR_KAFKA_SASL_PASSWORD", "s3cret")
    monkeypatch.setenv("COORDINATOR_KAFKA_RETRY_BUDGET_MS", "1234")
    options = Settings().kafka_options()
    assert options["retry_budget_ms"] == 1234
    assert options["client_config"] == {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_plain_password": "s3cret"}
    configured = build_control_plane("kafka", **options)
    try:
        assert configured.retry_budget_ms == 1234  # type: ignore[union-attr]
    finally:
        configured.close()  # type: ignore[union-attr]


# --- (g) end to end through the coordinator -----------------------------------------------------


@pytest.fixture
def wire_coordinator(engine: Engine, clock: ManualClock, plane: KafkaWireControlPlane) -> Iterator[Coordinator]:
    c = Coordinator(engine, plane, clock=clock, limits=Limits(max_partitions=256))
    yield c
    c.close()


def test_coordinator_commits_on_the_broker_and_aborts_a_superseded_attempt(
    faulty: tuple[TansuBroker, KafkaFaultProxy], wire_coordinator: Coordinator
) -> None:
    broker, proxy = faulty
    c = wire_coordinator
    name, batch = "orders", 7
    topic = broker.create_topic(2)
    c.register_sink(SinkSpec(name=name, transactional_id_prefix=tid("orders-eos"), bootstrap_servers=broker.bootstrap,
                             topics=[topic], transaction_timeout_ms=60_000), ACTOR)

    # attempt 1: one executor writes and pre-commits, then the driver dies
    gen1, _ = c.start_generation(name, "query-1", "run-1", ACTOR)
    first = c.begin_checkpoint(name, batch, gen1, ACTOR)
    assert first.action is BeginAction.NEW_ATTEMPT and first.attempt is not None
    stale_lease = c.begin_partition(name, batch, first.attempt.number, gen1, 0, 1)
    stale = ProducerProcess(broker.bootstrap, stale_lease.transactional_id, topic, partition=0, stay=True)
    try:
        s = stale.wait_ready()
        c.precommit(name, stale_lease.id, gen1, PrecommitRequest(s.producer_id, s.producer_epoch, s.records, 30))

        # the restarted driver's generation supersedes attempt 1: its lease is aborted on the broker
        proxy.clear()
        gen2, fenced = c.start_generation(name, "query-1", "run-2", ACTOR)
        assert fenced.aborted == [stale_lease.transactional_id] and fenced.pending == []
        assert proxy.requests[API_INIT_PRODUCER_ID] == 1
        assert stale.produce_more() == ["PRODUCER_FENCED"]  # the old producer's epoch is fenced
        assert markers(broker.bootstrap, topic, 0, s.producer_id) == ["abort"]
    finally:
        stale.close()

    # attempt 2: two executors (separate processes) write partitions 0 and 1 and pre-commit
    second = c.begin_checkpoint(name, batch, gen2, ACTOR)
    assert second.action is BeginAction.NEW_ATTEMPT and second.attempt is not None
    assert second.attempt.number == first.attempt.number + 1
    leases = [c.begin_partition(name, batch, second.attempt.number, gen2, p, 100 + p) for p in (0, 1)]
    stats = run_transactional_producers(broker.bootstrap, [(x.transactional_id, topic, x.partition) for x in leases])
    for lease, st in zip(leases, stats, strict=True):
        c.precommit(name, lease.id, gen2, PrecommitRequest(st.producer_id, st.producer_epoch, st.records, 30))
    assert is_open(broker.bootstrap, topic, 0) and is_open(broker.bootstrap, topic, 1)

    proxy.clear()
    result = c.commit(name, batch, second.attempt.number, gen2,
                      [PartitionResult(0, leases[0].id), PartitionResult(1, leases[1].id)], ACTOR)

    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert sorted(w.id for w in result.winners) == sorted(x.id for x in leases)
    assert all(w.state is LeaseState.COMMITTED for w in result.winners)
    assert proxy.requests[API_END_TXN] == 2 and proxy.injected[API_END_TXN] == 0  # both accepted first time
    for lease, st in zip(leases, stats, strict=True):
        log = partition_log(broker.bootstrap, topic, lease.partition)
        ended = log.markers(st.producer_id)  # the pool may have handed out the fenced id again
        assert ended[-1:] == ["commit"] and ended.count("commit") == 1, log.batches
        assert not log.has_open_transaction
    kinds = [ev["kind"] for ev in c.list_events(name, limit=1000)]
    assert "transactions_aborted" in kinds and "checkpoint_committed" in kinds and "commit_failed" not in kinds
    violations = check_invariants(c.snapshot(), settled=True)
    assert violations == [], [str(v) for v in violations]

    # replaying the batch after the commit skips it; a retried commit answers from the record
    again = c.begin_checkpoint(name, batch, gen2, ACTOR)
    assert again.action is BeginAction.SKIP
