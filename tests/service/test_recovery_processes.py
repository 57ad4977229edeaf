"""The recovery loop in real service processes (uvicorn, as deployed) on a real Postgres.

(a) The service is SIGKILLed after a commit decision and before the commits finish: the real
    Kafka control plane talks to the real broker through the fault-injecting proxy, which holds
    the EndTxn requests (never forwarding them) while two transactional producers in their own
    processes have pre-committed. A new service process's recovery loop finishes the checkpoint
    with no driver call: COMMITTED in the database, a COMMIT marker from each producer on its
    partition, and every record visible to a read_committed consumer exactly once.
(b) Two service processes with the loop enabled and a short leader TTL: exactly one leads (the
    leader row and each process's /metrics agree); SIGKILL the leader and the other takes over
    within TTL + one interval, and does the work (finishes a decided commit left behind).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, select, text

from coordinator.service.clock import ManualClock
from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import PartitionResult, PrecommitRecord
from coordinator.protocol.states import CheckpointState
from coordinator.service import Coordinator, SinkSpec
from coordinator.store.snapshot import snapshot
from coordinator.store.tables import checkpoints
from fixtures.kafka_producers import partition_log, run_transactional_producers, settled_partition_log
from fixtures.kafka_proxy import API_END_TXN
from fixtures.real_kafka import RealKafka
from fixtures.servers import ServiceProcess, Winner, start_services

pytestmark = pytest.mark.slow

ADMIN = "recovery-process-admin"
INTERVAL_MS = 200
TTL_MS = 1_000


def leader_row(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT holder, token, acquired_at, expires_at, expires_at > now() AS live FROM recovery_leader"
        )).one()
    return dict(row._mapping)


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, logs: Callable[[], str] = lambda: "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs()}")
        time.sleep(0.05)


def checkpoint_state(engine: Engine, batch_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(select(checkpoints.c.state).where(checkpoints.c.batch_id == batch_id)).scalar()


def pid_of(holder: str | None) -> int | None:
    return int(holder.split(":")[1]) if holder else None


@pytest.fixture
def services(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    for s in started:
        if s.alive:
            s.kill()


def loop_env(**extra: str) -> dict[str, str]:
    return {
        "COORDINATOR_RECOVERY_INTERVAL_MS": str(INTERVAL_MS),
        "COORDINATOR_RECOVERY_LEADER_TTL_MS": str(TTL_MS),
        **extra,
    }


# --- (a) SIGKILL between the commit decision and the commits ----------------------------------------


def test_sigkill_after_the_decision_and_the_recovery_loop_finishes_the_commit(
    kafka_faults: RealKafka, database_url: str, engine: Engine, tmp_path: Path,
    services: list[ServiceProcess],
) -> None:
    broker, proxy = kafka_faults, kafka_faults.proxy
    topic = broker.create_topic(2)
    env = loop_env(
        COORDINATOR_KAFKA_CONTROL_PLANE="kafka",
        COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS="2000",
        COORDINATOR_KAFKA_RETRY_BUDGET_MS="5000",
    )
    first = ServiceProcess(database_url, ADMIN, tmp_path, name="before-crash", env=env)
    services.append(first)
    first.start().wait_ready()
    admin = first.client(ADMIN)
    writer = admin.with_token(admin.register_sink("orders", "orders-crash", bootstrap_servers=broker.proxied_bootstrap,
                                                  topics=[topic], expect=201)["writer_token"])
    gen = writer.start_generation("orders", "query-1", "run-1")["generation"]
    attempt = writer.begin("orders", 0, gen)["attempt"]
    leases = [writer.lease("orders", 0, attempt, gen, p, 10 + p) for p in (0, 1)]
    # two executors (their own processes) write, flush, and hand their records to the driver
    stats = run_transactional_producers(broker.bootstrap, [(x["transactional_id"], topic, x["partition"]) for x in leases])
    winners = {x["partition"]: Winner.of(x, st.producer_id, producer_epoch=st.producer_epoch, records=st.records,
                                         bytes=30) for x, st in zip(leases, stats, strict=True)}
    assert all(partition_log(broker.bootstrap, topic, p).has_open_transaction for p in (0, 1))

    proxy.inject(API_END_TXN, action="hold", times=1_000_000)  # the commits hang on the way to Kafka
    answer: list[Any] = []

    def commit() -> None:
        try:
            answer.append(writer.commit("orders", 0, attempt, gen, winners, expect=None))
        except Exception as exc:  # noqa: BLE001 - the service dies under the call
            answer.append(exc)

    driver = threading.Thread(target=commit, daemon=True)
    driver.start()
    wait_for("the EndTxn requests to be held", lambda: proxy.held >= 1, 20, first.log)
    assert checkpoint_state(engine, 0) == "COMMITTING"  # the decision is durable

    assert first.kill() == -9  # SIGKILL while the commit call hangs
    driver.join(10)
    assert not driver.is_alive()
    assert not answer or getattr(answer[0], "status_code", None) != 200  # the driver never heard success
    wait_for("the held requests to be dropped", lambda: proxy.held == 0, 10)
    proxy.clear()  # the broker is reachable again; nothing held reached it
    for p, st in zip((0, 1), stats, strict=True):
        log = partition_log(broker.bootstrap, topic, p)
        assert log.has_open_transaction and log.markers(st.producer_id) == [], log.batches
    assert checkpoint_state(engine, 0) == "COMMITTING"

    # a new process on the same database; nobody calls it: its recovery loop takes over
    second = ServiceProcess(database_url, ADMIN, tmp_path, name="after-crash", env=env)
    services.append(second)
    started = time.monotonic()
    second.start().wait_ready()
    wait_for("the recovery loop to finish the commit", lambda: checkpoint_state(engine, 0) == "COMMITTED", 30,
             second.log)
    took = time.monotonic() - started

    for p, st in zip((0, 1), stats, strict=True):
        log = settled_partition_log(broker.bootstrap, topic, p)
        assert log.markers(st.producer_id) == ["commit"], log.batches
        assert not log.has_open_transaction
    assert proxy.requests[API_END_TXN] >= 2 and proxy.injected[API_END_TXN] == 0
    seen = sorted((m.partition(), m.value()) for m in broker.read_committed(topic))
    assert seen == sorted((p, b"record-%d" % i) for p in (0, 1) for i in range(3))
    assert pid_of(leader_row(engine)["holder"]) == second.proc.pid  # type: ignore[union-attr]
    events = second.client(ADMIN).request("GET", "/v1/sinks/orders/events", params={"limit": 1000})
    kinds = [ev["kind"] for ev in events]
    assert kinds.index("commit_decided") < kinds.index("checkpoint_committed")
    # the trail says recovery finished it (the commit call that decided writes no such event)
    (finished,) = [ev for ev in events if ev["kind"] == "checkpoint_committed"]
    assert finished["actor"] == "recovery" and finished["batch_id"] == 0
    assert finished["detail"] == {"batch_id": 0, "attempt": attempt, "by": "recovery_loop"}
    assert "data_lost" not in kinds
    with engine.connect() as conn:
        violations = check_invariants(snapshot(conn), settled=True)
    assert violations == [], [str(v) for v in violations]
    assert took < 30


# --- (b) two replicas, one leader, takeover ---------------------------------------------------------


def test_two_processes_one_leader_and_takeover_within_the_ttl(
    database_url: str, engine: Engine, tmp_path: Path, services: list[ServiceProcess]
) -> None:
    a, b = start_services(database_url, ADMIN, tmp_path, 2, env=loop_env())
    services.extend([a, b])
    by_pid = {s.proc.pid: s for s in (a, b)}  # type: ignore[union-attr]

    row = wait_for("a leader", lambda: (r := leader_row(engine))["live"] and r, 10)
    leader = by_pid[pid_of(row["holder"])]  # type: ignore[index]
    follower = b if leader is a else a
    # for a few intervals: always the same leader and token, and the processes agree
    for _ in range(8):
        now = leader_row(engine)
        assert now["holder"] == row["holder"] and now["token"] == row["token"] and now["live"]
        time.sleep(INTERVAL_MS / 1000)
    assert metric_of(leader, "coordinator_recovery_leader") == 1.0
    assert metric_of(follower, "coordinator_recovery_leader") == 0.0
    assert metric_of(leader, "coordinator_recovery_iterations_total") >= 3
    assert metric_of(follower, "coordinator_recovery_iterations_total") == 0

    before_kill = leader_row(engine)
    leader.kill()
    killed_at = time.monotonic()
    taken = wait_for("the follower to take over",
                     lambda: (r := leader_row(engine))["holder"] != before_kill["holder"] and r, 10, follower.log)
    took = time.monotonic() - killed_at
    assert pid_of(taken["holder"]) == follower.proc.pid  # type: ignore[union-attr]
    assert taken["token"] == before_kill["token"] + 1
    assert taken["acquired_at"] >= before_kill["expires_at"]  # never while the old lease was live
    assert took <= (TTL_MS + INTERVAL_MS) / 1000 + 1.0, took  # TTL + one interval (+ slack for a loaded box)
    assert metric_of(follower, "coordinator_recovery_leader") == 1.0

    # the new leader does the work: a decided commit left behind (its Kafka call failed) finishes
    kafka = RecordingControlPlane()
    c = Coordinator(engine, kafka, clock=ManualClock())
    try:
        c.register_sink(SinkSpec(name="views", transactional_id_prefix="views-eos", bootstrap_servers="kafka:9092",
                                 topics=["v"]), "test")
        gen, _ = c.start_generation("views", "q", "r", "test")
        number = c.begin_checkpoint("views", 5, gen, "test").attempt.number  # type: ignore[union-attr]
        x = c.begin_partition("views", 5, number, gen, 0, 1)
        kafka.fail_next(ControlPlaneError("down", retriable=True))
        with pytest.raises(e.Unavailable):
            c.commit("views", 5, number, gen, [PartitionResult(0, x.id, PrecommitRecord(1, 42, 0, 3, 30))], "test")
        assert checkpoint_state(engine, 5) == CheckpointState.COMMITTING.value
    finally:
        c.close()
    wait_for("the new leader to finish the commit", lambda: checkpoint_state(engine, 5) == "COMMITTED", 10,
             follower.log)
    assert metric_of(follower, "coordinator_recovery_commits_finished_total", sink="views") == 1.0


def metric_of(service: ServiceProcess, name: str, **labels: str) -> float:
    body = httpx.get(service.url + "/metrics", timeout=5).text
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{label}}} " if label else f"{name} "
    for line in body.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return 0.0
