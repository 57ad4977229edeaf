"""Sinks over HTTP in-process (routes/sinks.py, routes/operator.py): registration refused when
the broker fails its checks or the timeout exceeds what the broker allows, a retried registration
answered from the record, the operator's broker check."""

from __future__ import annotations

from coordinator.kafka.control_plane import BrokerCheck, RecordingControlPlane
from coordinator.service import Coordinator
from fixtures.api_app import PREFIX, SINK, admin, error_of, http, invalid_fields  # noqa: F401 - fixtures
from fixtures.servers import ProtocolClient


def test_timeout_above_broker_max_is_explained(admin: ProtocolClient) -> None:
    resp = admin.register_sink("s2", "s2-tx", transaction_timeout_ms=3_600_000, expect=None)
    err = error_of(resp, 422, "transaction_timeout_above_broker_max")
    assert "transaction.max.timeout.ms=900000" in err["message"]
    assert [s["name"] for s in admin.request("GET", "/v1/sinks")] == []


def test_registration_is_refused_when_the_broker_fails_its_checks(
    admin: ProtocolClient, coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    kafka.broker_checks = [
        BrokerCheck("bootstrap", True, "bootstrap server answered: 1 broker(s)"),
        BrokerCheck("advertised_listeners", False, "no broker is reachable at its advertised address kafka:9092",
                    fix="set advertised.listeners to an address clients can reach"),
        BrokerCheck("prefix_unused", False, "broker does not support ListTransactions", verified=False),
    ]
    refused = admin.register_sink(SINK, PREFIX, expect=None)
    err = error_of(refused, 422, "broker_check_failed")
    assert "advertised_listeners" in err["message"] and "advertised.listeners" in err["message"]
    assert "prefix_unused" not in err["message"]  # a question the broker cannot answer does not block
    assert [c["name"] for c in err["detail"]["checks"]] == ["bootstrap", "advertised_listeners", "prefix_unused"]
    assert coordinator.list_sinks() == []

    registered = admin.register_sink(SINK, PREFIX, check_broker=False, expect=201)  # before Kafka exists
    # a retry of an existing registration answers from the record, whatever the broker says now
    again = admin.register_sink(SINK, PREFIX, expect=200)
    assert {**again, "warnings": None} == {**registered, "warnings": None}
    assert admin.register_sink(SINK, PREFIX, check_broker=False, expect=200) == registered  # same request, same answer
    assert registered["warnings"] and not again["warnings"]  # only the registration that skipped the check warns

    kafka.broker_checks = [BrokerCheck("prefix_unused", False, "broker does not support ListTransactions", verified=False)]
    assert admin.register_sink("other", "other-eos", expect=201)["sink"]["name"] == "other"
    checks = admin.request("POST", "/v1/sinks/other/broker-check")
    assert checks == [{"name": "prefix_unused", "ok": False, "verdict": "broker does not support ListTransactions",
                       "fix": None, "verified": False}]


def test_a_prune_of_young_history_is_refused_naming_its_field(admin: ProtocolClient) -> None:
    """Every 422 names its fields in error.detail.fields, the service's own refusals too."""
    resp = admin.request("POST", "/v1/history/prune", {"older_than_s": 60}, expect=None)
    err = error_of(resp, 422, "invalid_prune")
    assert "history younger than 1:00:00 is kept" in err["message"]
    assert invalid_fields(resp) == ["older_than_s"]
