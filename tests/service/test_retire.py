"""Retiring a sink (admin, POST /v1/sinks/{name}/retire, `coordinator retire`): refused while
anything of it may be open, then kept for the audit trail and refusing every later call.
In-process API over a real Postgres (record-only control plane: this is about bookkeeping)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.http.api import create_app
from coordinator.protocol import rules
from coordinator.service import Coordinator
from coordinator.store.tables import events
from fixtures.servers import ProtocolClient

ADMIN = "retire-admin"


@pytest.fixture
def admin(coordinator: Coordinator) -> Iterator[ProtocolClient]:
    with TestClient(create_app(coordinator, admin_token=ADMIN, token_secret=b"s")) as client:
        yield ProtocolClient(client, ADMIN)


def test_a_sink_is_retired_only_when_nothing_is_open_and_then_takes_no_calls(
        admin: ProtocolClient, coordinator: Coordinator) -> None:
    reg = admin.register_sink("orders", "orders", topics=["out"], check_broker=False, expect=201)
    w = admin.with_token(reg["writer_token"])
    gen = w.start_generation("orders", "q-1", "r-1")["generation"]
    attempt = w.begin("orders", 0, gen)["attempt"]
    w.lease("orders", 0, attempt, gen, partition=0, task_attempt_id=1)

    blocked = admin.request("POST", "/v1/sinks/orders/retire", {"reason": "moved"}, expect=409)
    assert blocked["error"]["reason"] == "sink_has_open_transactions"
    assert "1 undecided attempt(s)" in blocked["error"]["message"]
    assert "may hold a transaction" in blocked["error"]["message"]  # the lease

    admin.request("POST", f"/v1/sinks/orders/checkpoints/0/attempts/{attempt}/abort", {"reason": "stop"})
    retired = admin.request("POST", "/v1/sinks/orders/retire", {"reason": "moved to orders-v2"})
    assert retired["name"] == "orders" and retired["retired_at"]
    again = admin.request("POST", "/v1/sinks/orders/retire", {"reason": "twice"})
    assert again["retired_at"] == retired["retired_at"]

    assert [s["name"] for s in admin.request("GET", "/v1/sinks")] == []
    for resp in (w.request("POST", "/v1/sinks/orders/checkpoints/1/begin", {"generation": gen}, expect=None),
                 w.request("POST", "/v1/sinks/orders/generations", {"query_id": "q-1", "run_id": "r-2"}, expect=None),
                 admin.register_sink("orders", "orders", topics=["out"], check_broker=False, expect=None)):
        assert resp.status_code == 409 and resp.json()["error"]["reason"] == "sink_retired", resp.text
    # a prefix is never reused, even after retirement (ids of the old sink may still be known to Kafka)
    clash = admin.register_sink("orders-v2", "orders", topics=["out"], check_broker=False, expect=409)
    assert clash["error"]["reason"] == "transactional_id_prefix_clash"
    # the audit trail: its events are kept, the retirement with who and why
    with coordinator.engine.connect() as conn:
        kinds = [(r.kind, r.detail) for r in conn.execute(select(events).order_by(events.c.id))]
    assert ("sink_retired", {"reason": "moved to orders-v2"}) in kinds
    assert kinds[0][0] == "sink_registered"
    trail = admin.request("GET", "/v1/sinks/orders/events")  # readable through the API too
    assert any(ev["kind"] == "sink_retired" for ev in trail)
    # the recovery loop no longer looks at it
    assert [s.name for s in coordinator.list_sinks()] == []


def test_the_retirement_rule_names_each_blocker() -> None:
    assert rules.retirement_blockers(0, 0, 0) == []
    assert len(rules.retirement_blockers(1, 1, 1)) == 3
    assert "decided commit(s) not finished" in rules.retirement_blockers(0, 2, 0)[0]
    assert "3 transactional id(s)" in rules.retirement_blockers(0, 0, 3)[0]
