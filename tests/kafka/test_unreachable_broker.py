"""A sink whose broker cannot be reached, on a coordinator with the real Kafka control plane (the
default): registration refuses it unless check_broker=false (then the answer warns), 20 s of the
recovery loop retrying it every 500 ms write a bounded number of log lines, and SIGTERM stops the process within
seconds. The "broker" is a free loopback port nobody listens on (connection refused at once), as
when Kafka is down."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from fixtures.servers import ServiceProcess, free_port

from coordinator.logs import RepeatLimit, subject

ADMIN = "unreachable-broker-admin"


def test_repeat_limit_lets_one_line_per_subject_and_interval_through_and_counts_the_rest() -> None:
    now = [0.0]
    limit = RepeatLimit(interval_s=60, clock=lambda: now[0])

    def record(name: str, msg: str, level: int = logging.WARNING) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, (), None)

    shown = []
    for i in range(600):  # ten minutes of a retry every second, from two loggers
        now[0] = float(i)
        for r in (record("kafka.net.manager", f"Bootstrap connection to 127.0.0.1:9 failed (backoff {i % 7}.{i} secs)"),
                  record("coordinator.service.recovery", f"step sweep of sink down failed ({i + 1} in a row; next try in 2.0 s)")):
            if limit.filter(r):
                shown.append(r.getMessage())
    assert len(shown) == 20, shown  # one per logger per minute
    assert "(59 similar line(s) in the last 60 s not shown)" in shown[2]
    # other loggers, and other brokers, are not held back
    assert limit.filter(record("coordinator.http.api", "x")) and limit.filter(record("coordinator.http.api", "x"))
    assert limit.filter(record("kafka.net.manager", "Bootstrap connection to 127.0.0.2:9 failed"))
    assert subject("connect to kafka-1:9092 failed after 3 tries") == "kafka-1:9092"


@pytest.mark.slow
def test_an_unreachable_broker_is_refused_then_retried_quietly_and_shutdown_is_fast(database_url: str,
                                                                                   tmp_path: Path) -> None:
    broker = f"127.0.0.1:{free_port()}"
    svc = ServiceProcess(database_url, ADMIN, tmp_path, env={
        "COORDINATOR_KAFKA_CONTROL_PLANE": "kafka",
        "COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS": "1000",
        "COORDINATOR_KAFKA_RETRY_BUDGET_MS": "3000",
        "COORDINATOR_RECOVERY_INTERVAL_MS": "500",
        "COORDINATOR_RECOVERY_SWEEP_INTERVAL_MS": "500",
    })
    with svc:
        admin = svc.client(ADMIN)
        body = {"bootstrap_servers": broker, "topics": ["out"]}
        refused = admin.register_sink("down", "down", expect=422, **body)
        assert refused["error"]["reason"] == "broker_check_failed"
        assert "check_broker=false" in refused["error"]["message"]
        answer = admin.register_sink("down", "down", check_broker=False, expect=201, **body)
        assert answer["warnings"] and f"the broker {broker} was not checked" in answer["warnings"][0]
        # the same registration again: 200, from the record, the same answer
        assert admin.register_sink("down", "down", check_broker=False, expect=200, **body) == answer
        admin.close()

        time.sleep(5)  # the recovery loop is sweeping the sink's broker by now
        before = len(svc.log_path.read_text().splitlines())
        time.sleep(20)  # 40 sweeps, each failing with a line or more of its own if nothing held them back
        lines = svc.log_path.read_text().splitlines()[before:]
        logged = [line for line in svc.log_path.read_text().splitlines() if broker in line]
        assert any(f"recovery loop: step sweep of cluster {broker} (sink down) failed" in line for line in logged), \
            svc.log()
        assert len(lines) <= 10, f"{len(lines)} log lines in 20 s of an unreachable broker:\n" + "\n".join(lines)

        started = time.monotonic()
        code = svc.stop(timeout_s=30)
        took = time.monotonic() - started
    # uvicorn re-raises SIGTERM after its graceful shutdown: -15 once "Application shutdown complete"
    assert code in (0, -15) and "Application shutdown complete" in svc.log(), f"exit {code} after {took:.1f} s\n" + svc.log()
    assert took < 8, f"SIGTERM took {took:.1f} s"


def test_a_sweep_the_broker_cannot_answer_is_logged_once_per_change_not_per_try(
        coordinator: Any, kafka: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A broker without KIP-664 (ListTransactions) fails every sweep the same way: one warning, then
    quiet (debug) until the step succeeds (one info line) or fails differently."""
    from coordinator.kafka.control_plane import ControlPlaneError
    from coordinator.service.recovery import RecoveryLoop
    from coordinator.service.results import SinkSpec

    coordinator.register_sink(SinkSpec("old-kafka", "old", "kafka-1:9092", ["out"]), "test", check_broker=False)
    lacking = ControlPlaneError("broker does not support ListTransactions (KIP-664, Kafka >= 3.0)", retriable=False,
                                code="unsupported_by_broker")
    loop = RecoveryLoop(coordinator, interval_ms=1_000, leader_ttl_ms=10_000, sweep_interval_ms=0)
    caplog.set_level(logging.DEBUG, logger="coordinator.service.recovery")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "coordinator.service.recovery" and
                r.levelno >= logging.WARNING and "step sweep" in r.getMessage()]
    try:
        kafka.fail_next(lacking, times=1_000)
        for _ in range(10):
            assert "sweep" in loop.run_once(honor_backoff=False).sinks["old-kafka"].errors
        assert len(warnings()) == 1 and "KIP-664" in warnings()[0]
        kafka.clear_failures()
        assert loop.run_once(honor_backoff=False).sinks["old-kafka"].errors == {}
        assert any("step sweep of cluster kafka-1:9092 (sink old-kafka) succeeds again after 10 failure(s)"
                   in r.getMessage()
                   for r in caplog.records)
        kafka.fail_next(ControlPlaneError("cannot bootstrap from kafka-1:9092", retriable=True, code="x"), times=10)
        loop.run_once(honor_backoff=False)
        assert len(warnings()) == 2 and "cannot bootstrap" in warnings()[1]
    finally:
        loop.stop()
