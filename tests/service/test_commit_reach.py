"""Defaults that keep I4. A decided commit may reach Kafka as late as its retry window (a
recovery-leader failover, the loop's interval, a retry budget, counted from the decision) plus a
request timeout after its decision, so a sink's commit margin must exceed that
(configuration.CommitReach). Registration refuses a sink that misses it (422 naming the numbers),
the settings refuse values under which no sink could keep it, and the defaults agree."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from fixtures.servers import ProtocolClient
from sqlalchemy import Engine

from coordinator.http.api import create_app
from coordinator.service.clock import ManualClock
from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol import configuration as config
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.settings import Settings

ADMIN = "reach-admin-token"
REACH = config.CommitReach(request_timeout_ms=5_000, retry_budget_ms=10_000, leader_ttl_ms=10_000,
                          recovery_interval_ms=2_000)


@pytest.fixture
def reaching(engine: Engine, clock: ManualClock) -> Iterator[Coordinator]:
    c = Coordinator(engine, RecordingControlPlane(), clock=clock, limits=Limits(commit_reach=REACH))
    yield c
    c.close()


def spec(name: str, timeout_ms: int = 60_000, margin_ms: int | None = None) -> SinkSpec:
    return SinkSpec(name, f"{name}-eos", "kafka:9092", ["out"], transaction_timeout_ms=timeout_ms,
                    commit_margin_ms=margin_ms)


def test_the_default_settings_agree() -> None:
    s = Settings(_env_file=None)
    reach = s.commit_reach()
    assert (reach.request_timeout_ms, reach.retry_budget_ms, reach.leader_ttl_ms, reach.recovery_interval_ms) == (
        s.kafka_request_timeout_ms, s.kafka_retry_budget_ms, s.recovery_leader_ttl_ms, s.recovery_interval_ms)
    assert reach.total_ms == 22_000
    margin = config.default_commit_margin_ms(60_000, reach)  # the default sink timeout
    assert reach.total_ms < margin == 25_000 < 60_000
    config.validate_commit_reach(60_000, margin, reach)  # does not raise


def test_registration_refuses_a_margin_at_or_below_the_commit_reach(reaching: Coordinator) -> None:
    for margin in (6_000, REACH.total_ms):
        with pytest.raises(e.Invalid) as exc:
            reaching.register_sink(spec(f"low{margin}", margin_ms=margin), "t")
        err = exc.value
        assert err.reason == "commit_margin_below_commit_reach" and err.status == 422
        assert f"commit_margin_ms={margin}" in err.message
        assert REACH.describe() in err.message
        assert "= 29000 ms" in err.message and "commit_margin_ms >= 32000" in err.message
    sink, created = reaching.register_sink(spec("enough", margin_ms=REACH.total_ms + 1), "t")
    assert created and sink.commit_margin_ms == REACH.total_ms + 1
    sink, _ = reaching.register_sink(spec("default"), "t")
    assert sink.commit_margin_ms == REACH.total_ms + config.REACH_SLACK_MS


def test_registration_refuses_a_timeout_that_leaves_no_room_above_the_reach(reaching: Coordinator) -> None:
    with pytest.raises(e.Invalid) as exc:
        reaching.register_sink(spec("short", timeout_ms=20_000), "t")
    assert exc.value.reason == "transaction_timeout_below_commit_reach"
    assert "transaction_timeout_ms=20000" in exc.value.message and "32000 ms" in exc.value.message


def test_the_api_answers_422_naming_the_numbers(reaching: Coordinator) -> None:
    with TestClient(create_app(reaching, admin_token=ADMIN, token_secret=b"s")) as http:
        admin = ProtocolClient(http, ADMIN)
        resp = admin.register_sink("api-low", "api-low", commit_margin_ms=6_000, expect=422)
    assert resp["error"]["reason"] == "commit_margin_below_commit_reach"
    assert resp["error"]["detail"]["commit_reach_ms"] == 29_000 and resp["error"]["detail"]["commit_margin_ms"] == 6_000


def test_settings_under_which_no_sink_could_keep_i4_are_refused_at_startup() -> None:
    with pytest.raises(ValidationError) as exc:
        Settings(_env_file=None, broker_max_transaction_timeout_ms=20_000)
    assert "no sink could keep I4" in str(exc.value) and "= 22000 ms" in str(exc.value)
    with pytest.raises(ValidationError) as exc:
        Settings(_env_file=None, recovery_interval_ms=10_000, recovery_leader_ttl_ms=10_000)
    assert "must exceed COORDINATOR_RECOVERY_INTERVAL_MS=10000" in str(exc.value)
