"""The Kafka control plane (`KafkaWireControlPlane`) on a real Apache Kafka broker (localkafka/,
tests/fixtures/real_kafka.py), formatted with `transaction.version=1` and with `=2` wherever the resume path
is involved: the coordinator sends EndTxn v<=4 and librdkafka's producers are TV1 clients on both.

What the real broker answers (Kafka 4.x, both transaction versions), and these tests pin:
- EndTxn(commit) from a process that never produced, with the stored id/pid/epoch: NONE; the
  records become visible to a read_committed consumer.
- The same EndTxn(commit) repeated: NONE (right after the first, CONCURRENT_TRANSACTIONS while
  the markers are written, then NONE); nothing is written twice.
- InitProducerId on an id with an open transaction: CONCURRENT_TRANSACTIONS while the broker
  aborts it, then NONE with a bumped epoch; the live producer's next Produce is fenced.
- Refusals: a stale or newer epoch -> PRODUCER_FENCED (90); a producer id the transactional id
  does not hold, or an id the broker never saw -> INVALID_PRODUCER_ID_MAPPING (49); a transaction
  the broker aborted at its own timeout -> PRODUCER_FENCED at the late resume (the server bumped
  the epoch), so a late commit fails loudly, never silently.
The fault proxy in front of the broker (tests/fixtures/kafka_proxy.py) loses answers and injects the
transient answers a healthy single broker does not give on cue (NOT_COORDINATOR,
COORDINATOR_LOAD_IN_PROGRESS, ...); it never stands in for a refusal.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fixtures.kafka_producers import (
    ProducerProcess,
    fenced,
    partition_log,
    run_transactional_producer,
    run_transactional_producers,
    settled_partition_log,
)
from fixtures.kafka_proxy import API_END_TXN, API_FIND_COORDINATOR, API_INIT_PRODUCER_ID
from fixtures.real_kafka import RealKafka
from sqlalchemy import Engine

from coordinator.service.clock import ManualClock
from coordinator.kafka import build_control_plane
from coordinator.kafka.control_plane import ControlPlaneError, KafkaTarget, PreparedTransaction
from coordinator.kafka.wire.control_plane import KafkaWireControlPlane
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import PartitionResult, PrecommitRecord
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import CheckpointState, LeaseState
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.settings import Settings
from localkafka import free_port

REQUEST_TIMEOUT_MS = 2_000
BUDGET_MS = 4_000
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
    return settled_partition_log(bootstrap, topic, partition).markers(producer_id)


def visible(broker: RealKafka, topic: str) -> list[bytes]:
    """What a read_committed consumer sees (it waits for every partition's last stable offset)."""
    return [m.value() for m in broker.read_committed(topic)]


def refused(call: Any) -> ControlPlaneError:
    """The broker refused for good: raised at once, not retried through the budget."""
    started = time.monotonic()
    with pytest.raises(ControlPlaneError) as exc:
        call()
    assert exc.value.retriable is False, exc.value
    assert time.monotonic() - started < BUDGET_MS / 1000, "a refusal must not wait out the retry budget"
    return exc.value


@pytest.fixture
def broker(kafka_each_tv: RealKafka) -> Iterator[RealKafka]:
    """A broker of each transaction version, its fault proxy cleared."""
    kafka_each_tv.proxy.clear()
    kafka_each_tv.proxy.release()
    yield kafka_each_tv
    kafka_each_tv.proxy.clear()
    kafka_each_tv.proxy.release()


@pytest.fixture
def plane() -> Iterator[KafkaWireControlPlane]:
    p = KafkaWireControlPlane(request_timeout_ms=REQUEST_TIMEOUT_MS, retry_budget_ms=BUDGET_MS,
                              retry_backoff_ms=40, retry_backoff_max_ms=300)
    yield p
    p.close()


# --- (a) resume-commit from another process ----------------------------------------------------


def test_resume_commit_from_another_process(broker: RealKafka, plane: KafkaWireControlPlane) -> None:
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic, records=5)  # exits, no commit
    assert stats.producer_id >= 0 and stats.producer_epoch >= 0
    before = partition_log(broker.bootstrap, topic, 0)
    assert before.high_watermark == 5 and before.last_stable_offset == 0, "the transaction should be open"

    plane.commit(target(broker.bootstrap), prepared(stats))

    assert visible(broker, topic) == [b"record-%d" % i for i in range(5)]
    after = settled_partition_log(broker.bootstrap, topic, 0)
    assert after.markers(stats.producer_id) == ["commit"]
    assert after.last_stable_offset == after.high_watermark


# --- (b) a retried commit is success -------------------------------------------------------------


def test_retried_commit_of_a_completed_transaction_is_success(broker: RealKafka, plane: KafkaWireControlPlane) -> None:
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    plane.commit(target(broker.proxied_bootstrap), prepared(stats))
    broker.proxy.clear()

    plane.commit(target(broker.proxied_bootstrap), prepared(stats))  # a second finisher, same pid and epoch

    # answered NONE (after CONCURRENT_TRANSACTIONS while the first commit's markers are written)
    assert 1 <= broker.proxy.requests[API_END_TXN] <= 10
    assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["commit"]
    assert visible(broker, topic) == [b"record-0", b"record-1", b"record-2"]


def test_commit_whose_answer_was_lost_is_retried_to_success(broker: RealKafka, plane: KafkaWireControlPlane) -> None:
    """The broker applies EndTxn but the connection dies before its answer arrives: the retry of
    the same commit (same epoch) is answered NONE, so the call succeeds."""
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    broker.proxy.inject(API_END_TXN, action="drop")

    plane.commit(target(broker.proxied_bootstrap), prepared(stats))

    assert broker.proxy.injected[API_END_TXN] == 1
    assert broker.proxy.requests[API_END_TXN] >= 2  # the applied one whose answer was lost, and the retry
    assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["commit"]
    assert visible(broker, topic) == [b"record-0", b"record-1", b"record-2"]


def test_a_delayed_commit_answer_within_the_request_timeout_is_one_request(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    broker.proxy.inject(API_END_TXN, action="delay", delay_s=REQUEST_TIMEOUT_MS / 1000 / 4)
    plane.commit(target(broker.proxied_bootstrap), prepared(stats))
    assert broker.proxy.requests[API_END_TXN] == 1
    assert len(visible(broker, topic)) == 3


# --- (c) abort by re-initialising the id --------------------------------------------------------


@pytest.mark.parametrize("late, refused_as_fenced", [
    (["_FENCED"], True), (["PRODUCER_FENCED"], True),
    (["INVALID_PRODUCER_EPOCH", "_FENCED"], True),  # librdkafka sometimes fails the record first
    ([None], False), ([None, "_FENCED"], False), ([], False), (["INVALID_PRODUCER_EPOCH"], False),
    (["_MSG_TIMED_OUT"], False), (["_FENCED", "_MSG_TIMED_OUT"], False),
])
def test_the_fence_check_accepts_only_a_late_record_refused_by_the_fence(
    late: list[str | None], refused_as_fenced: bool
) -> None:
    assert fenced(late) is refused_as_fenced


def test_abort_fences_the_live_producer_and_the_old_epoch_can_no_longer_commit(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = broker.create_topic(1)
    producer = ProducerProcess(broker.bootstrap, tid(), topic, stay=True)
    try:
        stats = producer.wait_ready()
        assert is_open(broker.bootstrap, topic, 0)
        broker.proxy.clear()

        plane.abort(target(broker.proxied_bootstrap), stats.transactional_id)

        # Kafka answers CONCURRENT_TRANSACTIONS while it writes the abort markers, then NONE
        assert broker.proxy.requests[API_INIT_PRODUCER_ID] >= 2
        assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["abort"]
        assert not is_open(broker.bootstrap, topic, 0)
        # the still-running producer holds the old epoch: the broker fences it
        late = producer.produce_more()
        assert fenced(late), late
        # a resume-commit with the old epoch is refused
        assert refused(lambda: plane.commit(target(broker.bootstrap), prepared(stats))).code == "producer_fenced"
        assert visible(broker, topic) == []  # no commit slipped in
    finally:
        producer.close()


def test_abort_of_an_id_nobody_used_is_harmless(broker: RealKafka, plane: KafkaWireControlPlane) -> None:
    name = tid("never-used")
    plane.abort(target(broker.bootstrap), name)  # initialises it; nothing to abort
    plane.abort(target(broker.bootstrap), name)
    # and the id serves its next producer as any other: its transaction commits, its records visible
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, name, topic)
    plane.commit(target(broker.bootstrap), prepared(stats))
    assert visible(broker, topic) == [b"record-0", b"record-1", b"record-2"]


# --- (d) every refusal Kafka sends ---------------------------------------------------------------


def test_stale_and_newer_epochs_are_fenced_and_the_current_one_commits(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = broker.create_topic(1)
    name = tid()
    first = run_transactional_producer(broker.bootstrap, name, topic)
    second = run_transactional_producer(broker.bootstrap, name, topic)  # initialising again fences the first
    assert second.producer_id == first.producer_id
    assert second.producer_epoch > first.producer_epoch
    # the second init_transactions aborted the first producer's open transaction (it returns once the
    # markers are written; the second's own transaction stays open, so the log is read as it is)
    assert partition_log(broker.bootstrap, topic, 0).markers(first.producer_id)[:1] == ["abort"]
    tg = target(broker.bootstrap)

    for stale in (prepared(first), prepared(second, epoch=second.producer_epoch - 1),
                  prepared(second, epoch=second.producer_epoch + 1)):
        assert refused(lambda: plane.commit(tg, stale)).code == "producer_fenced"
    assert is_open(broker.bootstrap, topic, 0), "a refused commit ended the transaction"

    plane.commit(tg, prepared(second))
    assert visible(broker, topic) == [b"record-0", b"record-1", b"record-2"]  # the second producer's only


def test_wrong_or_unknown_producer_is_refused_and_commits_nothing(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    tg = target(broker.bootstrap)

    wrong_pid = refused(lambda: plane.commit(tg, prepared(stats, pid=stats.producer_id + 1000)))
    unknown_id = refused(lambda: plane.commit(tg, PreparedTransaction(tid("unknown"), stats.producer_id, 0)))
    assert (wrong_pid.code, unknown_id.code) == ("invalid_producer_id_mapping", "invalid_producer_id_mapping")
    assert is_open(broker.bootstrap, topic, 0)

    with pytest.raises(ControlPlaneError) as exc:  # never assigned: refused before any request
        plane.commit(tg, prepared(stats, pid=-1))
    assert exc.value.retriable is False

    plane.commit(tg, prepared(stats))
    assert len(visible(broker, topic)) == 3


def test_a_transaction_the_broker_timed_out_makes_the_late_resume_fail_loudly(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    """The broker aborts a transaction past its timeout and bumps the epoch (under both
    transaction versions): the late resume is PRODUCER_FENCED, never a silent success."""
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic, transaction_timeout_ms=1_000)
    deadline = time.monotonic() + 30
    while markers(broker.bootstrap, topic, 0, stats.producer_id) != ["abort"]:
        assert time.monotonic() < deadline, "the broker did not abort the timed-out transaction"
        time.sleep(0.3)

    late = refused(lambda: plane.commit(target(broker.bootstrap), prepared(stats)))

    assert late.code == "producer_fenced"
    assert visible(broker, topic) == []
    assert markers(broker.bootstrap, topic, 0, stats.producer_id) == ["abort"]


# --- (e) error classification (injected: a healthy broker does not send these on cue) ----------


@pytest.mark.parametrize(
    ("error_code", "code"),
    [
        (53, "transactional_id_authorization_failed"),
        (48, "invalid_txn_state"),
        (59, "unknown_producer_id"),
        (120, "transaction_abortable"),
        (-1, "unknown_server_error"),  # not known to be transient
        (12345, "kafka_error_12345"),  # a code this kafka-python does not know
    ],
)
def test_other_refusal_codes_are_not_retried(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane, error_code: int, code: str
) -> None:
    """The classification of refusals this single broker does not produce on demand (the ones it
    does are tested above, from the broker itself)."""
    kafka_faults.proxy.inject(API_END_TXN, error_code=error_code, times=100)
    exc = refused(lambda: plane.commit(target(kafka_faults.proxied_bootstrap), PreparedTransaction(tid(), 1, 0)))
    assert exc.code == code
    assert kafka_faults.proxy.requests[API_END_TXN] == 1  # answered once, not retried


@pytest.mark.parametrize(("error_code", "code"), [(53, "transactional_id_authorization_failed"),
                                                  (50, "invalid_transaction_timeout")])
def test_abort_refusals_are_not_retried(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane, error_code: int, code: str
) -> None:
    kafka_faults.proxy.inject(API_INIT_PRODUCER_ID, error_code=error_code, times=100)
    exc = refused(lambda: plane.abort(target(kafka_faults.proxied_bootstrap), tid()))
    assert exc.code == code
    assert kafka_faults.proxy.requests[API_INIT_PRODUCER_ID] == 1


def test_the_broker_refuses_a_timeout_above_its_maximum(real_kafka: RealKafka, plane: KafkaWireControlPlane) -> None:
    """INVALID_TRANSACTION_TIMEOUT from the broker itself (transaction.max.timeout.ms 900000)."""
    tg = KafkaTarget("orders", real_kafka.bootstrap, 900_001)
    assert refused(lambda: plane.abort(tg, tid())).code == "invalid_transaction_timeout"


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
    kafka_faults: RealKafka, plane: KafkaWireControlPlane,
    api_key: int, error_code: int, times: int, refinds: int,
) -> None:
    broker = kafka_faults
    topic = broker.create_topic(1)
    stats = run_transactional_producer(broker.bootstrap, tid(), topic)
    broker.proxy.clear()
    broker.proxy.inject(api_key, error_code=error_code, times=times)

    plane.commit(target(broker.proxied_bootstrap), prepared(stats))

    assert broker.proxy.injected[api_key] == times
    assert broker.proxy.requests[API_FIND_COORDINATOR] == 1 + refinds
    assert broker.proxy.requests[API_END_TXN] == 1 + (times if api_key == API_END_TXN else 0)
    assert len(visible(broker, topic)) == 3


def test_transient_answers_forever_give_up_as_retriable_in_bounded_time(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane
) -> None:
    kafka_faults.proxy.inject(API_END_TXN, error_code=51, times=10_000)
    started = time.monotonic()
    with pytest.raises(ControlPlaneError) as exc:
        plane.commit(target(kafka_faults.proxied_bootstrap), PreparedTransaction(tid(), 1, 0))
    elapsed = time.monotonic() - started
    assert (exc.value.retriable, exc.value.code, exc.value.unanswered) == (True, "concurrent_transactions", False)
    assert BUDGET_MS / 1000 * 0.5 < elapsed < (BUDGET_MS + REQUEST_TIMEOUT_MS) / 1000 + 1.5
    assert kafka_faults.proxy.requests[API_END_TXN] >= 4  # retried with backoff, not hammered
    assert kafka_faults.proxy.requests[API_END_TXN] <= 60


def test_a_held_request_times_out_and_is_retried_as_retriable(kafka_faults: RealKafka) -> None:
    """An EndTxn that never gets an answer (held in the network): the request times out, the call
    gives up as retriable within its budget, and the broker never saw it."""
    p = KafkaWireControlPlane(request_timeout_ms=400, retry_budget_ms=1_200, retry_backoff_ms=50)
    try:
        kafka_faults.proxy.inject(API_END_TXN, action="hold", times=100)
        started = time.monotonic()
        with pytest.raises(ControlPlaneError) as exc:
            p.commit(target(kafka_faults.proxied_bootstrap), PreparedTransaction(tid(), 1, 0))
        assert exc.value.retriable is True and exc.value.unanswered  # a commit pass tries no other winner
        assert time.monotonic() - started < 1.2 + 0.4 + 2.0
    finally:
        p.close()


def test_unreachable_bootstrap_is_retriable_after_bounded_time() -> None:
    closed = free_port()  # nothing listens there
    p = KafkaWireControlPlane(request_timeout_ms=300, retry_budget_ms=900, retry_backoff_ms=50)
    try:
        for call in (lambda: p.commit(target(f"127.0.0.1:{closed}"), PreparedTransaction("x", 1, 0)),
                     lambda: p.abort(target(f"127.0.0.1:{closed}"), "x")):
            started = time.monotonic()
            with pytest.raises(ControlPlaneError) as exc:
                call()
            assert (exc.value.retriable, exc.value.code, exc.value.unanswered) == (True, "broker_unreachable", True)
            assert time.monotonic() - started < 0.9 + 0.3 + 1.5  # budget + one request, slack for load
    finally:
        p.close()
    with pytest.raises(ControlPlaneError) as after_close:
        p.commit(target(f"127.0.0.1:{closed}"), PreparedTransaction("x", 1, 0))
    assert (after_close.value.retriable, after_close.value.code) == (True, "closed")


def test_concurrent_calls_on_an_unreachable_bootstrap_each_give_up_within_their_budget() -> None:
    """Twelve calls at once (a commit pass runs 16): each waits for another's bootstrap no longer
    than its own request could take, so each ends within its budget, not behind eleven timeouts."""
    closed = free_port()
    p = KafkaWireControlPlane(request_timeout_ms=300, retry_budget_ms=900, retry_backoff_ms=50)
    took: list[float] = []
    errors: list[ControlPlaneError] = []

    def call(i: int) -> None:
        started = time.monotonic()
        try:
            p.commit(target(f"127.0.0.1:{closed}"), PreparedTransaction(f"x{i}", 1, 0))
        except ControlPlaneError as exc:
            errors.append(exc)
        took.append(time.monotonic() - started)

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        p.close()
    assert len(errors) == 12 and all(x.retriable and x.unanswered for x in errors)
    assert max(took) < 0.9 + 0.3 + 1.5, sorted(took)  # budget + one request, slack for load (12 x 0.3 s queued)


# --- (f) parallel commits ----------------------------------------------------------------------


def test_parallel_commits_and_aborts_share_one_connection_per_bootstrap(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane
) -> None:
    broker = kafka_faults
    topic = broker.create_topic(6)
    stats = run_transactional_producers(broker.bootstrap, [(tid(f"p{i}"), topic, i) for i in range(6)])
    assert all(is_open(broker.bootstrap, topic, i) for i in range(6))
    broker.proxy.clear()
    tg = target(broker.proxied_bootstrap)

    def finish(i: int) -> None:
        if i < 4:
            plane.commit(tg, prepared(stats[i]))
        else:
            plane.abort(tg, stats[i].transactional_id)

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(finish, range(6)))

    assert broker.proxy.requests[API_END_TXN] == 4
    assert broker.proxy.requests[API_INIT_PRODUCER_ID] >= 2  # with CONCURRENT_TRANSACTIONS while aborting
    assert broker.proxy.connections <= 2, broker.proxy.connections  # bootstrap + coordinator (one node)
    ended = [markers(broker.bootstrap, topic, i, stats[i].producer_id) for i in range(6)]
    assert ended == [["commit"]] * 4 + [["abort"]] * 2
    assert sorted(m.partition() for m in broker.read_committed(topic)) == [p for p in range(4) for _ in range(3)]


@pytest.mark.parametrize("way", ["calls", "pass"])
def test_more_parallel_calls_than_requests_in_flight_wait_for_a_slot_instead_of_failing(
    real_kafka: RealKafka, caplog: pytest.LogCaptureFixture, way: str
) -> None:
    """kafka-python fails a request at once when its connection has max_in_flight outstanding;
    the control plane makes the extra calls wait for a slot, whether they come from 12 threads or
    from one pass 16 wide: no spurious retry, every commit lands."""
    topic = real_kafka.create_topic(4)
    stats = run_transactional_producers(real_kafka.bootstrap, [(tid(f"s{i}"), topic, i % 4) for i in range(12)],
                                        records=1)
    p = KafkaWireControlPlane(request_timeout_ms=REQUEST_TIMEOUT_MS, retry_budget_ms=BUDGET_MS,
                              client_config={"max_in_flight_requests_per_connection": 2})
    tg = target(real_kafka.bootstrap)
    try:
        with caplog.at_level("WARNING", logger="coordinator.kafka.wire"):
            if way == "pass":
                assert [o.error for o in p.commit_all(tg, [prepared(st) for st in stats], 16)] == [None] * 12
            else:
                with ThreadPoolExecutor(max_workers=12) as pool:
                    list(pool.map(lambda st: p.commit(tg, prepared(st)), stats))
    finally:
        p.close()
    assert [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()] == []
    assert len(real_kafka.read_committed(topic)) == 12


# --- (f2) a pass: every transaction of a batch in one call (commit_all, abort_all) ---------------


def test_a_pass_commits_each_transaction_with_one_find_and_one_end_txn(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = broker.create_topic(6)
    stats = run_transactional_producers(broker.bootstrap, [(tid(f"a{i}"), topic, i) for i in range(6)])
    broker.proxy.clear()

    outcomes = plane.commit_all(target(broker.proxied_bootstrap), [prepared(st) for st in stats], 4)

    assert [o.error for o in outcomes] == [None] * 6
    assert all(o.seconds > 0 for o in outcomes)
    assert broker.proxy.requests[API_END_TXN] == 6
    assert broker.proxy.requests[API_FIND_COORDINATOR] == 6  # one per transactional id, then cached
    assert [markers(broker.bootstrap, topic, i, stats[i].producer_id) for i in range(6)] == [["commit"]] * 6
    assert sorted(m.partition() for m in broker.read_committed(topic)) == [p for p in range(6) for _ in range(3)]
    # a pass of a retried commit: each completed transaction answered NONE again, nothing written twice
    again = plane.commit_all(target(broker.proxied_bootstrap), [prepared(st) for st in stats], 4)
    assert [o.error for o in again] == [None] * 6
    assert len(visible(broker, topic)) == 18


@pytest.mark.parametrize(
    ("error_code", "times", "refinds"),
    [
        (51, 3, 0),  # CONCURRENT_TRANSACTIONS
        (16, 2, 2),  # NOT_COORDINATOR: those ids' coordinator found again, the others' kept
        (7, 1, 0),  # REQUEST_TIMED_OUT, as the broker answers it
    ],
)
def test_a_pass_retries_transient_answers_of_the_transactions_that_got_them(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane, error_code: int, times: int, refinds: int
) -> None:
    broker = kafka_faults
    topic = broker.create_topic(4)
    stats = run_transactional_producers(broker.bootstrap, [(tid(f"r{i}"), topic, i) for i in range(4)])
    broker.proxy.clear()
    broker.proxy.inject(API_END_TXN, error_code=error_code, times=times)

    outcomes = plane.commit_all(target(broker.proxied_bootstrap), [prepared(st) for st in stats], 2)

    assert [o.error for o in outcomes] == [None] * 4
    assert broker.proxy.injected[API_END_TXN] == times
    assert broker.proxy.requests[API_END_TXN] == 4 + times
    assert broker.proxy.requests[API_FIND_COORDINATOR] == 4 + refinds
    assert len(visible(broker, topic)) == 12


def test_a_pass_looks_up_again_only_the_coordinators_of_the_transactions_told_to(
    kafka_faults: RealKafka, plane: KafkaWireControlPlane
) -> None:
    """In one round, one EndTxn answered NOT_COORDINATOR and one CONCURRENT_TRANSACTIONS: only the
    first's coordinator is looked up again before the next round."""
    broker = kafka_faults
    topic = broker.create_topic(2)
    stats = run_transactional_producers(broker.bootstrap, [(tid(f"n{i}"), topic, i) for i in range(2)])
    broker.proxy.clear()
    broker.proxy.inject(API_END_TXN, error_code=16, times=1)
    broker.proxy.inject(API_END_TXN, error_code=51, times=1)

    outcomes = plane.commit_all(target(broker.proxied_bootstrap), [prepared(st) for st in stats], 2)

    assert [o.error for o in outcomes] == [None, None]
    assert broker.proxy.requests[API_END_TXN] == 4
    assert broker.proxy.requests[API_FIND_COORDINATOR] == 2 + 1
    assert len(visible(broker, topic)) == 6


def test_a_pass_ends_a_refused_transaction_at_once_and_commits_the_others(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = broker.create_topic(3)
    stats = run_transactional_producers(broker.bootstrap, [(tid(f"f{i}"), topic, i) for i in range(3)])
    txns = [prepared(stats[0]), prepared(stats[1], epoch=stats[1].producer_epoch + 1), prepared(stats[2]),
            PreparedTransaction(tid("never"), -1, -1)]
    broker.proxy.clear()
    started = time.monotonic()

    outcomes = plane.commit_all(target(broker.proxied_bootstrap), txns, 16)

    assert time.monotonic() - started < BUDGET_MS / 1000, "a refusal must not wait out the retry budget"
    assert outcomes[0].error is None and outcomes[2].error is None
    fenced_ = outcomes[1].error
    assert fenced_ is not None and (fenced_.code, fenced_.retriable, fenced_.transaction_gone) == (
        "producer_fenced", False, True)
    assert outcomes[3].error is not None and outcomes[3].error.code == "invalid_producer_id"
    assert broker.proxy.requests[API_END_TXN] == 3  # the refused one once, the unassigned one never
    assert markers(broker.bootstrap, topic, 0, stats[0].producer_id) == ["commit"]
    assert markers(broker.bootstrap, topic, 2, stats[2].producer_id) == ["commit"]
    assert is_open(broker.bootstrap, topic, 1)
    plane.abort(target(broker.bootstrap), stats[1].transactional_id)


def test_a_pass_on_a_silent_broker_tries_as_many_as_it_runs_at_once_and_reports_the_rest_not_tried(
    kafka_faults: RealKafka,
) -> None:
    """EndTxn never answered (held in the network): the first round's tries time out, the round
    starts no other, and at the end of the budget those report the timeout (retriable, unanswered),
    the others NOT_TRIED; the broker never saw any of them."""
    p = KafkaWireControlPlane(request_timeout_ms=400, retry_budget_ms=1_200, retry_backoff_ms=50)
    try:
        kafka_faults.proxy.inject(API_END_TXN, action="hold", times=1_000)
        started = time.monotonic()
        outcomes = p.commit_all(target(kafka_faults.proxied_bootstrap),
                                [PreparedTransaction(tid(f"h{i}"), 1, 0) for i in range(10)], 3)
        elapsed = time.monotonic() - started
    finally:
        p.close()
    codes = [o.error.code if o.error else None for o in outcomes]
    assert codes == ["request_timed_out"] * 3 + ["not_tried"] * 7, codes
    assert all(o.error is not None and o.error.retriable and not o.error.transaction_gone for o in outcomes)
    assert all(o.error is not None and o.error.unanswered for o in outcomes[:3])
    assert elapsed < 1.2 + 0.4 + 2.0
    assert kafka_faults.proxy.requests[API_END_TXN] <= 3 * 3  # at most a few rounds of the first three


def test_a_pass_on_an_unreachable_bootstrap_gives_up_within_its_budget() -> None:
    closed = free_port()
    p = KafkaWireControlPlane(request_timeout_ms=300, retry_budget_ms=900, retry_backoff_ms=50)
    try:
        for call in (lambda: p.commit_all(target(f"127.0.0.1:{closed}"),
                                          [PreparedTransaction(f"x{i}", 1, 0) for i in range(5)], 2),
                     lambda: p.abort_all(target(f"127.0.0.1:{closed}"), [f"x{i}" for i in range(5)], 2)):
            started = time.monotonic()
            outcomes = call()
            assert time.monotonic() - started < 0.9 + 0.3 + 1.5
            assert [o.error.code if o.error else None for o in outcomes] == ["broker_unreachable"] * 2 + ["not_tried"] * 3
    finally:
        p.close()
    after_close = p.commit_all(target(f"127.0.0.1:{closed}"), [PreparedTransaction("x", 1, 0)], 2)
    assert after_close[0].error is not None and (after_close[0].error.code, after_close[0].error.retriable) == (
        "closed", True)


def test_abort_all_fences_each_id_and_waits_for_the_aborts_to_complete(
    broker: RealKafka, plane: KafkaWireControlPlane
) -> None:
    topic = broker.create_topic(3)
    stats = run_transactional_producers(broker.bootstrap, [(tid(f"x{i}"), topic, i) for i in range(3)])
    unused = tid("unused")
    broker.proxy.clear()

    outcomes = plane.abort_all(target(broker.proxied_bootstrap), [st.transactional_id for st in stats] + [unused], 16)

    assert [o.error for o in outcomes] == [None] * 4
    # the broker answers CONCURRENT_TRANSACTIONS while it writes the abort markers: retried until NONE
    assert broker.proxy.requests[API_INIT_PRODUCER_ID] >= 4
    assert [markers(broker.bootstrap, topic, i, stats[i].producer_id) for i in range(3)] == [["abort"]] * 3
    assert visible(broker, topic) == []
    for st in stats:  # the old epoch can no longer commit
        assert refused(lambda st=st: plane.commit(target(broker.bootstrap), prepared(st))).transaction_gone


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
    broker: RealKafka, wire_coordinator: Coordinator
) -> None:
    proxy = broker.proxy
    c = wire_coordinator
    name, batch = "orders", 7
    topic = broker.create_topic(2)
    c.register_sink(SinkSpec(name=name, transactional_id_prefix=tid("orders-eos"), bootstrap_servers=broker.proxied_bootstrap,
                             topics=[topic], transaction_timeout_ms=60_000), ACTOR)

    # attempt 1: one executor writes and flushes (its record on its way to the driver), then the driver dies
    gen1, _ = c.start_generation(name, "query-1", "run-1", ACTOR)
    first = c.begin_checkpoint(name, batch, gen1, ACTOR)
    assert first.action is BeginAction.NEW_ATTEMPT and first.attempt is not None
    stale_lease = c.begin_partition(name, batch, first.attempt.number, gen1, 0, 1)
    stale = ProducerProcess(broker.bootstrap, stale_lease.transactional_id, topic, partition=0, stay=True)
    try:
        s = stale.wait_ready()

        # the restarted driver's generation supersedes attempt 1: its lease is aborted on the broker
        proxy.clear()
        gen2, superseded = c.start_generation(name, "query-1", "run-2", ACTOR)
        assert superseded.aborted == [stale_lease.transactional_id] and superseded.pending == []
        assert proxy.requests[API_INIT_PRODUCER_ID] >= 2  # CONCURRENT_TRANSACTIONS while aborting, then NONE
        late = stale.produce_more()
        assert fenced(late), late  # the old producer's epoch is fenced
        assert markers(broker.bootstrap, topic, 0, s.producer_id) == ["abort"]
    finally:
        stale.close()

    # attempt 2: two executors (separate processes) write partitions 0 and 1; their records come with the commit
    second = c.begin_checkpoint(name, batch, gen2, ACTOR)
    assert second.action is BeginAction.NEW_ATTEMPT and second.attempt is not None
    assert second.attempt.number == first.attempt.number + 1
    leases = [c.begin_partition(name, batch, second.attempt.number, gen2, p, 100 + p) for p in (0, 1)]
    stats = run_transactional_producers(broker.bootstrap, [(x.transactional_id, topic, x.partition) for x in leases])
    assert is_open(broker.bootstrap, topic, 0) and is_open(broker.bootstrap, topic, 1)

    proxy.clear()
    result = c.commit(name, batch, second.attempt.number, gen2,
                      [PartitionResult(x.partition, x.id, PrecommitRecord(x.task_attempt_id, st.producer_id,
                                                                          st.producer_epoch, st.records, 30))
                       for x, st in zip(leases, stats, strict=True)], ACTOR)

    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert sorted(w.id for w in result.winners) == sorted(x.id for x in leases)
    assert all(w.state is LeaseState.COMMITTED for w in result.winners)
    assert proxy.requests[API_END_TXN] == 2 and proxy.injected[API_END_TXN] == 0  # both accepted first time
    for lease, st in zip(leases, stats, strict=True):
        log = settled_partition_log(broker.bootstrap, topic, lease.partition)
        ended = log.markers(st.producer_id)  # the pool may have handed out the fenced id again
        assert ended[-1:] == ["commit"] and ended.count("commit") == 1, log.batches
        assert not log.has_open_transaction
    # what a reader sees: both winners' records once, nothing of the superseded attempt
    seen = sorted((m.partition(), m.value()) for m in broker.read_committed(topic))
    assert seen == sorted((p, b"record-%d" % i) for p in (0, 1) for i in range(3))
    kinds = [ev["kind"] for ev in c.list_events(name, limit=1000)]
    assert "transactions_aborted" in kinds and "commit_failed" not in kinds
    # committed by the call that decided: its decision is the batch's one event
    assert "checkpoint_committed" not in kinds and kinds.count("commit_decided") == 1
    violations = check_invariants(c.snapshot(), settled=True)
    assert violations == [], [str(v) for v in violations]

    # replaying the batch after the commit skips it; a retried commit answers from the record
    again = c.begin_checkpoint(name, batch, gen2, ACTOR)
    assert again.action is BeginAction.SKIP
