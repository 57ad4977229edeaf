"""The writer's coordinator client against a scripted HTTP server (real sockets, stdlib
http.server), for answers the coordinator itself does not give on purpose: other 5xx from a proxy
in between, a 200 that is not the coordinator's JSON, a redirect; and a URL without a scheme.
No Spark, no Postgres: these tests take well under a second each."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from fixtures.servers import Script, scripted_http
from sparkclient import CoordinatorClient, CoordinatorError, WriterOptionError
from sparkclient.options import WriterOptions


@pytest.fixture
def scripted() -> Iterator[tuple[str, Script]]:
    with scripted_http() as served:
        yield served


SINK = json.dumps({"name": "s", "transaction_timeout_ms": 60000})


def error(reason: str) -> str:
    return json.dumps({"error": {"reason": reason, "message": f"{reason} happened"}})


def client(url: str, budget_s: float = 10.0) -> CoordinatorClient:
    return CoordinatorClient(url, "t", "s", timeout_s=5, retry_budget_s=budget_s, backoff_base_s=0.01,
                             backoff_max_s=0.02)


def test_any_5xx_and_429_from_a_proxy_are_retried(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(507, "<html>insufficient storage</html>", {"Content-Type": "text/html"}),
                      (501, "", {}), (429, "slow down", {"Content-Type": "text/plain"}), (200, SINK, {})]
    with client(url) as c:
        assert c.describe_sink()["name"] == "s"
    assert len(script.requests) == 4


def test_a_4xx_is_not_retried(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(409, error("stale_generation"), {}), (200, SINK, {})]
    with client(url) as c, pytest.raises(CoordinatorError) as refused:
        c.describe_sink()
    assert refused.value.status == 409 and "this driver is fenced" in str(refused.value)
    assert len(script.requests) == 1


def test_an_answer_that_is_not_the_coordinators_says_to_check_the_url(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(200, "<html>login</html>", {"Content-Type": "text/html"})]
    with client(url) as c, pytest.raises(CoordinatorError, match="not JSON.*check coordinator.url"):
        c.describe_sink()
    script.answers = [(308, "", {"Location": "https://elsewhere/v1/sinks/s"})]
    with client(url) as c, pytest.raises(CoordinatorError, match="redirect.*https://elsewhere.*coordinator.url"):
        c.describe_sink()
    assert len(script.requests) == 2  # neither is retried: repeating the call answers the same


def test_a_url_without_http_scheme_fails_at_once_naming_the_option() -> None:
    started = time.monotonic()
    with client("localhost:8000", budget_s=30) as c, pytest.raises(CoordinatorError, match="coordinator.url"):
        c.describe_sink()
    assert time.monotonic() - started < 20  # not retried for the whole budget
    base = {"kafka.bootstrap.servers": "k:9092", "topic": "t", "coordinator.token": "x", "coordinator.sink": "s",
            "checkpointLocation": "/tmp/chk"}
    for bad in ("localhost:8000", "ftp://c:8000", "http//c"):
        with pytest.raises(WriterOptionError, match="'coordinator.url' must start with http:// or https://"):
            WriterOptions.parse({**base, "coordinator.url": bad})
    assert WriterOptions.parse({**base, "coordinator.url": "HTTPS://c:8000"}).coordinator_url == "HTTPS://c:8000"


def test_executor_tasks_share_one_client_per_process_and_a_forked_worker_makes_its_own() -> None:
    """PySpark reuses a Python worker for many tasks (one client, one keep-alive connection) and
    forks workers from a daemon: a child must not talk over its parent's connections."""
    import os

    from sparkclient.executor import Coordinator

    def coordinator(timeout_ms: int = 30_000) -> Coordinator:
        return Coordinator("http://c:8000", "tok", "s", timeout_ms, 60_000)

    first = coordinator().client()
    assert coordinator().client() is first  # the same sink and options: the same client
    assert coordinator(timeout_ms=5_000).client() is not first
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child answers whether it got a client of its own
        try:
            os.write(write, b"own" if coordinator().client() is not first else b"shared")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 10)
    os.waitpid(child, 0)
    os.close(read)
    assert answer == b"own"
    assert coordinator().client() is first  # the parent keeps its own


# --- the task's own checks -----------------------------------------------------------------------


def test_a_task_refuses_init_on_a_lease_older_than_the_bound_and_a_transaction_inside_the_margin() -> None:
    """The lease's age is its age by the database's clock when answered plus this process's
    monotonic time since the answer arrived: no other machine's wall clock in the bound."""
    from sparkclient.executor import DeadlineTooClose, Lease, LeaseTooOld, check_deadline_outside_margin, \
        check_lease_young_enough

    arrived = 1_000.0  # time.monotonic() when the answer arrived
    lease = Lease(7, "p-3", 60_000, age_ms=2_000, max_init_age_ms=30_000, received_at=arrived)
    check_lease_young_enough(lease, arrived + 28.0)  # 2 s old when answered + 28 s since = 30 s
    with pytest.raises(LeaseTooOld, match="30001 ms old, above the 30000 ms bound"):
        check_lease_young_enough(lease, arrived + 28.001)
    check_deadline_outside_margin(lease, 6_000, arrived + 52.0)  # 54 s old: 6 s left, not inside
    with pytest.raises(DeadlineTooClose, match="5999 ms left"):
        check_deadline_outside_margin(lease, 6_000, arrived + 52.001)
    # a monotonic clock that went "back" (another process's reading) counts as no time, never negative
    check_lease_young_enough(Lease(8, "p-4", 60_000, 29_000, 30_000, arrived), arrived - 100.0)
    assert Lease.of_answer({"lease_id": 9, "transactional_id": "p-5", "transaction_timeout_ms": 60_000,
                            "age_ms": 12, "max_lease_init_age_ms": 30_000}, arrived).age_ms_at(arrived + 1) == 1_012


def test_the_producer_id_comes_from_librdkafka_s_eos_log_and_anything_but_one_pair_fails_the_task() -> None:
    """The lines as librdkafka 2.16 logs them (`debug=eos`); the real broker's COMMIT markers
    carry the pair read this way (tests/spark/test_spark_executor.py). Each broken variant is refused."""
    from sparkclient.transaction import EosLog, ProducerIdUnknown

    def fed(*lines: tuple[int, str, str]) -> EosLog:
        eos = EosLog()
        for level, facility, text in lines:
            eos.log(level, "%s [%s] %s", facility, "rdkafka#producer-1", text)
        return eos

    acquired = (10, "GETPID", "[thrd:main]: Acquired PID{Id:4001,Epoch:7}")
    newpid = (10, "NEWPID", "[thrd:127.0.0.1:9092/1]: t [0] changed PID{Invalid} -> PID{Id:4001,Epoch:7} with base MsgId 1")
    state = (10, "TXNSTATE", "[thrd:main]: Transaction state change Ready -> InTransaction")
    assert fed(state, acquired, newpid, newpid).producer_id_and_epoch("task") == (4001, 7)
    with pytest.raises(ProducerIdUnknown, match="named 0 producer id/epoch pairs"):
        fed(state, newpid).producer_id_and_epoch("task")
    again = (10, "GETPID", "[thrd:main]: Acquired PID{Id:4001,Epoch:8} (previous PID{Id:4001,Epoch:7})")
    with pytest.raises(ProducerIdUnknown, match="named 2 producer id/epoch pairs"):
        fed(acquired, again).producer_id_and_epoch("task")
    other = (10, "NEWPID", "[thrd:b/1]: t [1] changed PID{Id:4001,Epoch:7} -> PID{Id:4001,Epoch:8} with base MsgId 9")
    with pytest.raises(ProducerIdUnknown, match=r"produced with \[\(4001, 7\), \(4001, 8\)\]"):
        fed(acquired, newpid, other).producer_id_and_epoch("task")
    failed = fed(acquired, (40, "TXNERR", "[thrd:b/1]: Current transaction failed in state InTransaction: ..."))
    assert failed.errors and failed.producer_id_and_epoch("task") == (4001, 7)  # the caller refuses on errors


def test_the_native_sink_takes_spark_s_option_names_and_the_offsets_binding_is_a_stated_choice() -> None:
    base = {"kafka.bootstrap.servers": "k:9092", "topic": "t", "coordinator.url": "http://c:8000",
            "coordinator.token": "x", "coordinator.sink": "s"}
    # as Spark hands them to a Python data source: lower-case names, the query's checkpointLocation
    parsed = WriterOptions.parse({**base, "checkpointlocation": "/chk/q"}, from_spark=True)
    assert parsed.checkpoint_location == "/chk/q" and parsed.offsets_binding == "required"
    assert WriterOptions.parse(base, from_spark=True).checkpoint_location == ""  # a session default location
    with pytest.raises(WriterOptionError, match="option 'checkpointLocation' is required"):
        WriterOptions.parse(base)  # the foreachBatch writer needs it
    assert WriterOptions.parse({**base, "checkpointLocation": "/c", "offsets.binding": "OFF"}).offsets_binding == "off"
    with pytest.raises(WriterOptionError, match="'offsets.binding' must be 'required' or 'off'"):
        WriterOptions.parse({**base, "checkpointLocation": "/c", "offsets.binding": "maybe"})
    with pytest.raises(WriterOptionError, match=r"unknown option\(s\) \['skip.empty.batches'\]"):
        WriterOptions.parse({**base, "checkpointLocation": "/c", "skip.empty.batches": "true"})
    producer = WriterOptions.parse({**base, "checkpointLocation": "/c"}).producer_config
    assert producer["partitioner"] == "murmur2_random"  # the Java producer's key hash, as Spark's sink
    with pytest.raises(WriterOptionError, match="kafka.on_delivery"):
        WriterOptions.parse({**base, "checkpointLocation": "/c", "kafka.on_delivery": "x"})


def test_a_missing_offsets_entry_fails_the_batch_unless_the_user_turned_the_binding_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from sparkclient.checkpoint_files import OffsetsUnavailable, batch_offsets_digest, offsets_digest

    entry = 'v1\n{"batchWatermarkMs":0,"batchTimestampMs":123}\n{"logOffset":4}'
    assert batch_offsets_digest(entry, "/c/offsets/4", "required", "run") == offsets_digest(entry)
    # the batch's timestamp line is not what it reads: another timestamp, the same digest
    assert offsets_digest(entry.replace("123", "999")) == offsets_digest(entry) != offsets_digest(entry + "x")
    with pytest.raises(OffsetsUnavailable, match=r"/c/offsets/4: .*offsets.binding=off"):
        batch_offsets_digest(None, "/c/offsets/4", "required", "run")
    with caplog.at_level(logging.WARNING, logger="sparkclient.checkpoint_files"):
        for _ in range(3):
            assert batch_offsets_digest(None, "/c/offsets/4", "off", ("s", "run-a")) is None
        assert batch_offsets_digest(entry, "/c/offsets/5", "off", ("s", "run-a")) is None  # off means off
        batch_offsets_digest(None, "/c/offsets/4", "off", ("s", "run-b"))
    assert len([r for r in caplog.records if "offsets.binding=off" in r.message]) == 2  # once per run


def test_max_write_tasks_is_zero_or_more_and_the_native_sink_has_no_such_option() -> None:
    base = {"kafka.bootstrap.servers": "k:9092", "topic": "t", "coordinator.url": "http://c:8000",
            "coordinator.token": "x", "coordinator.sink": "s", "checkpointLocation": "/c"}
    assert WriterOptions.parse(base).max_write_tasks is None  # the Spark context's default parallelism
    assert WriterOptions.parse({**base, "max.write.tasks": "0"}).max_write_tasks == 0  # keep the partitions
    assert WriterOptions.parse({**base, "max.write.tasks": "16"}).max_write_tasks == 16
    with pytest.raises(WriterOptionError, match="'max.write.tasks' must be zero or more, got -1"):
        WriterOptions.parse({**base, "max.write.tasks": "-1"})
    with pytest.raises(WriterOptionError, match=r"unknown option\(s\) \['max.write.tasks'\]"):
        WriterOptions.parse({**base, "max.write.tasks": "2"}, from_spark=True)  # Spark plans the sink's tasks
