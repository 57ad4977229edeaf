"""Retiring a sink (admin, POST /v1/sinks/{name}/retire, `coordinator retire`): refused while
anything of it may be open (an undecided attempt, a decided commit not finished, an id that may
hold a transaction), then kept for the audit trail, holding nothing open (F2), and refusing every
later call. In-process API over a real Postgres (record-only control plane: this is about
bookkeeping); begin racing retirement is in test_fencing_races.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.http.api import create_app
from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_invariants
from coordinator.service import Coordinator
from coordinator.store.tables import events
from fixtures.protocol_calls import ACTOR, NAME, claimed, held, refused, start, won
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
    attempt = w.begin("orders", 0, gen, partitions=2)["attempt"]
    w.lease("orders", 0, attempt, gen, partition=0, task_attempt_id=1)

    blocked = admin.request("POST", "/v1/sinks/orders/retire", {"reason": "moved"}, expect=409)
    assert blocked["error"]["reason"] == "sink_has_open_transactions"
    assert "1 undecided attempt(s)" in blocked["error"]["message"]
    # the claimed lease and the pre-lease no try claimed yet (a try may still claim it)
    assert "2 transactional id(s) that may hold a transaction" in blocked["error"]["message"]

    admin.request("POST", f"/v1/sinks/orders/checkpoints/0/attempts/{attempt}/abort", {"reason": "stop"})
    retired = admin.request("POST", "/v1/sinks/orders/retire", {"reason": "moved to orders-v2"})
    assert retired["name"] == "orders" and retired["retired_at"]
    again = admin.request("POST", "/v1/sinks/orders/retire", {"reason": "twice"})
    assert again["retired_at"] == retired["retired_at"]

    assert [s["name"] for s in admin.request("GET", "/v1/sinks")] == []
    # its own writer token is told it is retired (any other token gets 403, tests/http)
    for resp in (w.request("POST", "/v1/sinks/orders/checkpoints/1/begin", {"generation": gen}, expect=None),
                 w.request("POST", "/v1/sinks/orders/generations", {"query_id": "q-1", "run_id": "r-2"}, expect=None)):
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
    # the recovery loop no longer looks at it, and it holds nothing open (F2)
    assert [s.name for s in coordinator.list_sinks()] == []
    assert [str(v) for v in check_invariants(coordinator.snapshot(), settled=True)] == []
    # registering its name again (same configuration) does not bring it back, nor mint it a token
    resp = admin.register_sink("orders", "orders", topics=["out"], check_broker=False, expect=None)
    assert resp.status_code == 409 and resp.json()["error"]["reason"] == "sink_retired", resp.text


def test_retirement_waits_for_a_decided_commit_and_for_every_abort(
        coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    (winner,) = claimed(c, 0, 1, gen, 1)
    loser = c.lease(NAME, 0, 1, gen, 0, 999).lease
    kafka.fail_next(ControlPlaneError("broker unreachable", retriable=True), times=2)  # the commit and the abort
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, 1, gen, [won(winner)], ACTOR)
    err = refused(c, kafka, lambda: c.retire_sink(NAME, "admin", "moved"), e.RETIREMENT_BLOCKED)
    assert "1 decided commit(s) not finished" in err.message and "2 transactional id(s)" in err.message
    c.resume(NAME, 0)  # the commit finishes; the loser's abort is done with it
    assert held(c) == []
    sink, retired_now = c.retire_sink(NAME, "admin", "moved")
    assert retired_now and sink.retired_at is not None
    assert c.retire_sink(NAME, "admin", "again") == (sink, False)  # a retry answers from the record
    assert [str(v) for v in check_invariants(c.snapshot(), settled=True)] == []
    assert loser.transactional_id in [t for _, t in kafka.aborts]
