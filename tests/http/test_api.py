"""REST API v1 in-process: FastAPI's TestClient over `create_app` on a real, freshly migrated
Postgres (the `coordinator` fixture, record-only Kafka control plane, manual clock).

Covers the full protocol cycle over HTTP, authentication and authorisation, the machine-readable
404/409/422 answers, retries answering the same, and the OpenAPI and readiness endpoints."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from coordinator.http.api import create_app
from coordinator.kafka.control_plane import PreparedTransaction, RecordingControlPlane
from coordinator.protocol.invariants import check_invariants, check_unchanged
from coordinator.service import Coordinator
from coordinator.store.db import make_engine
from fixtures.servers import ProtocolClient

ADMIN = "test-admin-token-7f3a"
SECRET = b"test-writer-token-secret"
SINK = "orders"
PREFIX = "orders-tx"


# --- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture
def http(coordinator: Coordinator) -> Iterator[TestClient]:
    with TestClient(create_app(coordinator, admin_token=ADMIN, token_secret=SECRET)) as client:
        yield client


@pytest.fixture
def admin(http: TestClient) -> ProtocolClient:
    return ProtocolClient(http, ADMIN)


def setup_sink(admin: ProtocolClient, name: str = SINK, prefix: str = PREFIX, **extra: Any) -> ProtocolClient:
    """Register a sink; returns a client holding its writer token."""
    registered = admin.register_sink(name, prefix, expect=201, **extra)
    assert registered["writer_token"].startswith("wt_")
    return admin.with_token(registered["writer_token"])


def setup_attempt(admin: ProtocolClient, batch_id: int = 0) -> tuple[ProtocolClient, int, int]:
    """Sink + generation + begun batch: (writer, generation, attempt)."""
    w = setup_sink(admin)
    gen = w.start_generation(SINK, "query-1", "run-1")["generation"]
    begun = w.begin(SINK, batch_id, gen)
    assert begun["action"] == "write"
    return w, gen, begun["attempt"]


def error_of(resp: httpx.Response, status: int, reason: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text}"
    err = resp.json()["error"]
    assert isinstance(err["reason"], str) and err["reason"]
    assert isinstance(err["message"], str) and err["message"]
    if reason is not None:
        assert err["reason"] == reason, err
    return err


def invalid_fields(resp: httpx.Response) -> list[str]:
    """A 422 names the offending fields in error.detail.fields (one shape for every 422)."""
    err = error_of(resp, 422)
    fields = [f["field"] for f in err["detail"]["fields"]]
    for f in err["detail"]["fields"]:
        assert f["message"], err
    for name in fields:
        assert name in err["message"], err
    return fields


# --- the protocol over HTTP ------------------------------------------------------------------


def test_full_cycle(admin: ProtocolClient, coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    registered = admin.register_sink(SINK, PREFIX, topics=["orders"], transaction_timeout_ms=120_000, expect=201)
    sink = registered["sink"]
    assert sink["name"] == SINK and sink["transactional_id_prefix"] == PREFIX
    assert sink["transaction_timeout_ms"] == 120_000 and sink["commit_margin_ms"] == 12_000
    assert sink["generation"] == 0 and sink["lineage_query_id"] is None
    w = admin.with_token(registered["writer_token"])
    assert w.request("GET", f"/v1/sinks/{SINK}")["name"] == SINK  # a writer may read its sink

    g = w.start_generation(SINK, "query-1", "run-1")
    assert g == {"generation": 1, "aborted": [], "abort_pending": []}
    gen = g["generation"]

    begun = w.begin(SINK, 0, gen)
    assert begun == {
        "action": "write", "batch_id": 0, "state": "OPEN", "attempt": 1,
        "resumed": False, "aborted": [], "abort_pending": [],
        "pre_leases": [],  # no partition count given (an older client): every task leases its own
        "commit_margin_ms": 12000, "max_lease_init_age_ms": 30000,
        "producer_init_timeout_ms": 60000, "producer_request_timeout_ms": 60000,
    }

    # partition 0: one task; partition 1: a task and its speculative copy; partition 2: empty
    l0 = w.lease(SINK, 0, 1, gen, partition=0, task_attempt_id=100)
    l1 = w.lease(SINK, 0, 1, gen, partition=1, task_attempt_id=101)
    l1s = w.lease(SINK, 0, 1, gen, partition=1, task_attempt_id=201)
    tids = {l0["transactional_id"], l1["transactional_id"], l1s["transactional_id"]}
    assert tids == {f"{PREFIX}-0", f"{PREFIX}-1", f"{PREFIX}-2"}
    for lease in (l0, l1, l1s):
        assert lease["state"] == "LEASED" and lease["attempt"] == 1
        assert lease["transaction_timeout_ms"] == 120_000

    p0 = w.precommit(SINK, l0["lease_id"], gen, producer_id=7000, producer_epoch=3, records=5, bytes=500)
    assert p0["state"] == "PRECOMMITTED" and (p0["producer_id"], p0["producer_epoch"], p0["records"]) == (7000, 3, 5)
    w.precommit(SINK, l1["lease_id"], gen, producer_id=7001, producer_epoch=0, records=2, bytes=20)
    w.precommit(SINK, l1s["lease_id"], gen, producer_id=7002, producer_epoch=1, records=2, bytes=20)

    done = w.commit(SINK, 0, 1, gen, {0: l0["lease_id"], 1: l1s["lease_id"], 2: None})
    assert done["state"] == "COMMITTED" and done["batch_id"] == 0 and done["attempt"] == 1
    assert [(c["partition"], c["lease_id"], c["producer_id"], c["producer_epoch"]) for c in done["committed"]] == [
        (0, l0["lease_id"], 7000, 3),
        (1, l1s["lease_id"], 7002, 1),
    ]
    assert done["aborted"] == [l1["transactional_id"]] and done["abort_pending"] == []
    # Kafka was asked to commit exactly the winners by resume, and to abort the loser
    assert sorted(kafka.commits, key=lambda c: c[1].producer_id) == [
        (SINK, PreparedTransaction(l0["transactional_id"], 7000, 3)),
        (SINK, PreparedTransaction(l1s["transactional_id"], 7002, 1)),
    ]
    assert kafka.aborts == [(SINK, l1["transactional_id"])]

    # a replay of the batch after the commit skips writing
    again = w.begin(SINK, 0, gen)
    assert again["action"] == "skip" and again["state"] == "COMMITTED"

    detail = w.checkpoint(SINK, 0)
    assert detail["checkpoint"]["state"] == "COMMITTED" and detail["checkpoint"]["committed_attempt"] == 1
    assert [a["state"] for a in detail["attempts"]] == ["COMMITTED"]
    assert detail["attempts"][0]["partitions"] == 3
    states = {x["lease_id"]: x["state"] for x in detail["leases"]}
    assert states == {l0["lease_id"]: "COMMITTED", l1["lease_id"]: "ABORTED", l1s["lease_id"]: "COMMITTED"}
    assert w.request("GET", f"/v1/sinks/{SINK}/transactions/open") == []
    assert [c["batch_id"] for c in w.request("GET", f"/v1/sinks/{SINK}/checkpoints")] == [0]
    kinds = [ev["kind"] for ev in w.request("GET", f"/v1/sinks/{SINK}/events")]
    for kind in ("sink_registered", "generation_started", "commit_decided"):
        assert kind in kinds
    # one event per batch (its decision); the attempt and checkpoint rows above record begin and commit
    trail = w.request("GET", f"/v1/sinks/{SINK}/events", params={"batch_id": 0})
    assert [(ev["kind"], ev["batch_id"]) for ev in trail] == [("commit_decided", 0)]
    assert detail["attempts"][0]["started_at"] and detail["checkpoint"]["committed_at"]

    # the next batch reuses the pool: every id was resolved, none is new
    b1 = w.begin(SINK, 1, gen)
    assert b1["action"] == "write" and b1["attempt"] == 1
    lease = w.lease(SINK, 1, 1, gen, partition=0, task_attempt_id=300)
    assert lease["transactional_id"] == f"{PREFIX}-0"
    w.precommit(SINK, lease["lease_id"], gen, producer_id=7003)
    assert w.commit(SINK, 1, 1, gen, {0: lease["lease_id"]})["state"] == "COMMITTED"
    assert [c["batch_id"] for c in w.request("GET", f"/v1/sinks/{SINK}/checkpoints")] == [1, 0]

    snap = coordinator.snapshot()
    assert len(snap.transactional_ids) == 3
    assert check_invariants(snap, settled=True) == []


def test_batch_figures_are_stored_and_read_back(admin: ProtocolClient) -> None:
    """Per-batch figures for operators: the executor's write time comes with the pre-commit and is
    kept on the lease, the driver's job time comes with the commit and is kept on the attempt;
    both are optional, and a retried pre-commit with another write time is still the same one."""
    w, gen, attempt = setup_attempt(admin)
    l0 = w.lease(SINK, 0, attempt, gen, partition=0, task_attempt_id=1)
    l1 = w.lease(SINK, 0, attempt, gen, partition=1, task_attempt_id=2)
    body = {"generation": gen, "producer_id": 51, "producer_epoch": 0, "records": 4, "bytes": 40, "write_ms": 37}
    assert w.request("POST", f"/v1/sinks/{SINK}/leases/{l0['lease_id']}/precommit", body)["write_ms"] == 37
    again = w.request("POST", f"/v1/sinks/{SINK}/leases/{l0['lease_id']}/precommit", {**body, "write_ms": 99})
    assert again["write_ms"] == 37 and again["state"] == "PRECOMMITTED"
    assert w.precommit(SINK, l1["lease_id"], gen, producer_id=52)["write_ms"] is None  # optional
    bad = w.request("POST", f"/v1/sinks/{SINK}/leases/{l0['lease_id']}/precommit", {**body, "write_ms": -1},
                    expect=None)
    assert invalid_fields(bad) == ["write_ms"]
    commit = {"generation": gen, "job_ms": 1234, "partitions": [
        {"partition": 0, "lease_id": l0["lease_id"]}, {"partition": 1, "lease_id": l1["lease_id"]}]}
    assert w.request("POST", f"/v1/sinks/{SINK}/checkpoints/0/attempts/{attempt}/commit", commit)["state"] == "COMMITTED"
    detail = w.checkpoint(SINK, 0)
    assert [a["job_ms"] for a in detail["attempts"]] == [1234]
    assert {x["partition"]: (x["records"], x["bytes"], x["write_ms"]) for x in detail["leases"]} == {
        0: (4, 40, 37), 1: (10, 1000, None)}


def test_a_checkpoints_leases_come_in_pages_with_their_counts(admin: ProtocolClient) -> None:
    """A wide batch has a lease per partition and try: the detail lists them by id, a page at a
    time, with the checkpoint's lease count by state and where the next page starts."""
    w, gen, attempt = setup_attempt(admin)
    firsts = [w.lease(SINK, 0, attempt, gen, partition=p, task_attempt_id=p) for p in range(5)]
    retry = w.lease(SINK, 0, attempt, gen, partition=0, task_attempt_id=99)  # the loser of partition 0
    for x in [*firsts, retry]:
        w.precommit(SINK, x["lease_id"], gen, producer_id=7000 + x["lease_id"])
    assert w.checkpoint(SINK, 0)["records"] is None  # nothing decided yet
    assert w.commit(SINK, 0, attempt, gen, {x["partition"]: x["lease_id"] for x in firsts})["state"] == "COMMITTED"
    every = sorted(x["lease_id"] for x in [*firsts, retry])

    listed, after, pages = [], 0, 0
    while after is not None:
        page = w.request("GET", f"/v1/sinks/{SINK}/checkpoints/0", params={"lease_limit": 2, "after_lease_id": after})
        assert page["lease_counts"] == {"ABORTED": 1, "COMMITTED": 5}
        assert [a["number"] for a in page["attempts"]] == [attempt] and page["checkpoint"]["state"] == "COMMITTED"
        assert all(x["attempt"] == attempt for x in page["leases"])
        listed += [x["lease_id"] for x in page["leases"]]
        after, pages = page["next_after_lease_id"], pages + 1
    assert listed == every and pages == 3
    whole = w.checkpoint(SINK, 0)  # the default page holds a thousand
    assert [x["lease_id"] for x in whole["leases"]] == every and whole["next_after_lease_id"] is None
    assert (whole["records"], whole["bytes"]) == (5 * 10, 5 * 1000)  # the winners' sums, not the loser's
    aborted = w.request("GET", f"/v1/sinks/{SINK}/checkpoints/0", params={"lease_state": "ABORTED"})
    assert [x["lease_id"] for x in aborted["leases"]] == [retry["lease_id"]] and aborted["lease_counts"]["COMMITTED"] == 5
    for bad in ({"lease_state": "DONE"}, {"lease_limit": 0}, {"lease_limit": 1001}, {"after_lease_id": -1}):
        error_of(w.request("GET", f"/v1/sinks/{SINK}/checkpoints/0", params=bad, expect=None), 422)


def test_abort_by_driver_then_new_attempt(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen, attempt = setup_attempt(admin)
    l0 = w.lease(SINK, 0, attempt, gen, partition=0, task_attempt_id=1)
    out = w.abort(SINK, 0, attempt, gen, reason="job failed")
    assert out["attempt"]["state"] == "ABORTED" and out["attempt"]["abort_reason"] == "job failed"
    assert out["aborted"] == [l0["transactional_id"]]
    # a writer must name its generation to abort
    error_of(w.abort(SINK, 0, attempt, None, expect=None), 422, "generation_required")
    begun = w.begin(SINK, 0, gen)
    assert begun["attempt"] == 2 and begun["action"] == "write"
    assert check_invariants(coordinator.snapshot(), settled=True) == []


# --- authentication and authorisation ----------------------------------------------------------


def test_401_without_a_token(http: TestClient, admin: ProtocolClient) -> None:
    w = setup_sink(admin)
    anon = ProtocolClient(http, None)
    error_of(anon.register_sink("other", "other-tx", expect=None), 401, "unauthenticated")
    error_of(anon.request("GET", "/v1/sinks", expect=None), 401, "unauthenticated")
    error_of(anon.start_generation(SINK, "q", "r", expect=None), 401, "unauthenticated")
    error_of(anon.begin(SINK, 0, 1, expect=None), 401, "unauthenticated")
    # not a bearer token
    basic = http.get(f"/v1/sinks/{SINK}", headers={"Authorization": f"Basic {w.token}"})
    error_of(basic, 401, "unauthenticated")
    # nothing was registered by the refused call
    assert [s["name"] for s in admin.request("GET", "/v1/sinks")] == [SINK]


def test_403_with_a_wrong_token(admin: ProtocolClient) -> None:
    setup_sink(admin)
    wrong = admin.with_token("not-the-admin-token")
    error_of(wrong.register_sink("other", "other-tx", expect=None), 403, "forbidden")
    error_of(wrong.request("GET", "/v1/sinks", expect=None), 403, "forbidden")
    error_of(wrong.start_generation(SINK, "q", "r", expect=None), 403, "forbidden")
    error_of(wrong.request("GET", f"/v1/sinks/{SINK}", expect=None), 403, "forbidden")
    # a writer-looking token for an unknown sink is 403 too: tokens do not probe sink names
    error_of(wrong.begin("no-such-sink", 0, 1, expect=None), 403, "forbidden")


def test_writer_token_is_scoped_to_its_sink(admin: ProtocolClient, coordinator: Coordinator) -> None:
    wa = setup_sink(admin, "sink-a", "a-tx")
    wb = setup_sink(admin, "sink-b", "b-tx")
    assert wa.token != wb.token
    gen_b = wb.start_generation("sink-b", "qb", "rb")["generation"]
    wb.begin("sink-b", 0, gen_b)
    before = coordinator.snapshot()
    # A's token on B's routes
    error_of(wa.start_generation("sink-b", "qa", "ra", expect=None), 403, "forbidden")
    error_of(wa.begin("sink-b", 0, gen_b, expect=None), 403, "forbidden")
    error_of(wa.lease("sink-b", 0, 1, gen_b, 0, 1, expect=None), 403, "forbidden")
    error_of(wa.request("GET", "/v1/sinks/sink-b", expect=None), 403, "forbidden")
    error_of(wa.request("GET", "/v1/sinks/sink-b/events", expect=None), 403, "forbidden")
    assert check_unchanged(before, coordinator.snapshot()) == []
    # and on its own sink it works
    assert wa.start_generation("sink-a", "qa", "ra")["generation"] == 1


def test_writer_token_cannot_do_admin_actions(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w = setup_sink(admin)
    w.start_generation(SINK, "query-1", "run-1")
    before = coordinator.snapshot()
    error_of(w.register_sink("other", "other-tx", expect=None), 403, "forbidden")
    error_of(w.register_sink(SINK, PREFIX, expect=None), 403, "forbidden")
    error_of(w.reset_lineage(SINK, expect=None), 403, "forbidden")
    error_of(w.rotate_writer_token(SINK, expect=None), 403, "forbidden")
    error_of(w.request("GET", "/v1/sinks", expect=None), 403, "forbidden")
    assert check_unchanged(before, coordinator.snapshot()) == []
    # the admin token is accepted on a sink's protocol routes (operator actions)
    assert admin.request("GET", f"/v1/sinks/{SINK}")["lineage_query_id"] == "query-1"


def test_rotated_writer_token_stops_working(admin: ProtocolClient) -> None:
    old = setup_sink(admin)
    gen = old.start_generation(SINK, "query-1", "run-1")["generation"]  # warms the token cache
    rotated = admin.rotate_writer_token(SINK)
    new = admin.with_token(rotated["writer_token"])
    assert new.token != old.token
    error_of(old.begin(SINK, 0, gen, expect=None), 403, "forbidden")
    error_of(old.request("GET", f"/v1/sinks/{SINK}", expect=None), 403, "forbidden")
    assert new.begin(SINK, 0, gen)["action"] == "write"
    # registering the same sink again hands out the current token, not the old one
    again = admin.register_sink(SINK, PREFIX, expect=200)
    assert again["writer_token"] == new.token


# --- 404 -------------------------------------------------------------------------------------


def test_404_for_unknown_sink_checkpoint_attempt_lease(admin: ProtocolClient) -> None:
    w, gen, attempt = setup_attempt(admin)
    error_of(admin.request("GET", "/v1/sinks/no-such-sink", expect=None), 404, "unknown_sink")
    error_of(admin.begin("no-such-sink", 0, 1, expect=None), 404, "unknown_sink")
    error_of(admin.rotate_writer_token("no-such-sink", expect=None), 404, "unknown_sink")

    err = error_of(w.checkpoint(SINK, 42, expect=None), 404, "unknown_checkpoint")
    assert err["detail"]["batch_id"] == 42
    error_of(w.lease(SINK, 42, 1, gen, 0, 1, expect=None), 404, "unknown_checkpoint")
    error_of(w.lease(SINK, 0, 9, gen, 0, 1, expect=None), 404, "unknown_attempt")
    error_of(w.commit(SINK, 0, 9, gen, {0: None}, expect=None), 404, "unknown_attempt")
    err = error_of(w.precommit(SINK, 999_999, gen, producer_id=1, expect=None), 404, "unknown_lease")
    assert err["detail"]["lease_id"] == 999_999

    # a lease id of another sink is unknown under this one (admin token: no auth short-cut)
    other = setup_sink(admin, "other", "other-tx")
    og = other.start_generation("other", "qo", "ro")["generation"]
    other.begin("other", 0, og)
    foreign = other.lease("other", 0, 1, og, 0, 1)
    error_of(admin.precommit(SINK, foreign["lease_id"], gen, producer_id=1, expect=None), 404, "unknown_lease")


# --- 409 -------------------------------------------------------------------------------------


def test_409_stale_generation(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen1, attempt = setup_attempt(admin)
    lease = w.lease(SINK, 0, attempt, gen1, 0, 1)
    w.precommit(SINK, lease["lease_id"], gen1, producer_id=11)
    # the query restarts: a new driver fences the old one and its open attempt
    g2 = w.start_generation(SINK, "query-1", "run-2")
    assert g2["generation"] == gen1 + 1 and g2["aborted"] == [lease["transactional_id"]]

    before = coordinator.snapshot()
    for resp in (
        w.begin(SINK, 0, gen1, expect=None),
        w.begin(SINK, 1, gen1, expect=None),
        w.lease(SINK, 0, attempt, gen1, 1, 2, expect=None),
        w.precommit(SINK, lease["lease_id"], gen1, producer_id=11, expect=None),
        w.commit(SINK, 0, attempt, gen1, {0: lease["lease_id"]}, expect=None),
        w.abort(SINK, 0, attempt, gen1, expect=None),
        w.start_generation(SINK, "query-1", "run-1", expect=None),  # the old driver retrying its start
    ):
        err = error_of(resp, 409, "stale_generation")
        assert err["detail"]["current_generation"] == g2["generation"]
    error_of(w.begin(SINK, 0, g2["generation"] + 1, expect=None), 409, "unknown_generation")
    assert check_unchanged(before, coordinator.snapshot()) == []  # I5


def test_409_superseded_attempt(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen, _ = setup_attempt(admin)
    old = w.lease(SINK, 0, 1, gen, 0, 1)
    w.precommit(SINK, old["lease_id"], gen, producer_id=21)
    # batch 1 begins (batch 0's attempt 1 is dead), then batch 0 is retried under attempt 2
    w.begin(SINK, 1, gen)
    b0 = w.begin(SINK, 0, gen)
    assert b0["attempt"] == 2 and b0["aborted"] == [old["transactional_id"]]

    before = coordinator.snapshot()
    err = error_of(w.lease(SINK, 0, 1, gen, 1, 5, expect=None), 409, "stale_attempt")
    assert err["detail"]["current_attempt"] == 2
    error_of(w.commit(SINK, 0, 1, gen, {0: old["lease_id"]}, expect=None), 409, "stale_attempt")
    # the superseded attempt's lease itself is no longer live
    error_of(w.lease(SINK, 0, 1, gen, 0, 1, expect=None), 409, "stale_lease")
    # and a winner of the old attempt cannot be named by the new one
    error_of(w.commit(SINK, 0, 2, gen, {0: old["lease_id"]}, expect=None), 409, "stale_lease")
    assert check_unchanged(before, coordinator.snapshot()) == []


def test_409_lineage_mismatch_and_reset(admin: ProtocolClient) -> None:
    w = setup_sink(admin)
    gen1 = w.start_generation(SINK, "query-1", "run-1")["generation"]
    err = error_of(w.start_generation(SINK, "query-2", "run-9", expect=None), 409, "lineage_mismatch")
    assert err["detail"] == {"bound_query_id": "query-1", "query_id": "query-2"}
    # only an operator may hand the sink to the new query
    error_of(w.reset_lineage(SINK, expect=None), 403, "forbidden")
    reset = admin.reset_lineage(SINK, "moved checkpoint location")
    assert reset["lineage_query_id"] is None and reset["generation"] == gen1 + 1
    g = w.start_generation(SINK, "query-2", "run-9")
    assert g["generation"] == gen1 + 2
    error_of(w.begin(SINK, 0, gen1, expect=None), 409, "stale_generation")
    assert w.begin(SINK, 0, g["generation"])["action"] == "write"


def test_409_other_conflicts(admin: ProtocolClient, coordinator: Coordinator, clock: Any) -> None:
    w, gen, attempt = setup_attempt(admin)
    # a sink name with another configuration, a prefix overlapping another sink's
    err = error_of(admin.register_sink(SINK, "elsewhere", expect=None), 409, "sink_exists")
    assert err["detail"]["existing"]["transactional_id_prefix"] == PREFIX
    error_of(admin.register_sink("orders2", PREFIX + "-x", expect=None), 409, "transactional_id_prefix_clash")
    error_of(admin.register_sink("orders3", "orders", expect=None), 409, "transactional_id_prefix_clash")

    a = w.lease(SINK, 0, attempt, gen, 0, 1)
    b = w.lease(SINK, 0, attempt, gen, 1, 2)
    w.precommit(SINK, a["lease_id"], gen, producer_id=31, records=3)
    error_of(w.precommit(SINK, a["lease_id"], gen, producer_id=31, records=4, expect=None), 409, "precommit_mismatch")
    error_of(w.commit(SINK, 0, attempt, gen, {0: a["lease_id"], 1: b["lease_id"]}, expect=None),
             409, "winner_not_precommitted")
    error_of(w.commit(SINK, 0, attempt, gen, {0: b["lease_id"], 1: a["lease_id"]}, expect=None),
             409, "lease_mismatch")

    # the timeout gate: 55 s into a 60 s transaction is inside the 6 s margin
    clock.advance(seconds=55)
    err = error_of(w.precommit(SINK, b["lease_id"], gen, producer_id=32, expect=None), 409, "transaction_deadline_too_close")
    assert err["detail"]["margin_ms"] == 6000
    err = error_of(w.commit(SINK, 0, attempt, gen, {0: a["lease_id"], 1: None}, expect=None),
                   409, "transaction_deadline_too_close")
    assert err["detail"]["lease_ids"] == [a["lease_id"]]
    # the refusal aborted the attempt; a retry is refused the same way and a replay starts afresh
    error_of(w.commit(SINK, 0, attempt, gen, {0: a["lease_id"], 1: None}, expect=None),
             409, "transaction_deadline_too_close")
    assert w.checkpoint(SINK, 0)["attempts"][0]["state"] == "ABORTED"
    assert w.begin(SINK, 0, gen)["attempt"] == attempt + 1
    assert check_invariants(coordinator.snapshot(), settled=True) == []


# --- 422 -------------------------------------------------------------------------------------


def test_422_names_the_field(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen, attempt = setup_attempt(admin)
    lease = w.lease(SINK, 0, attempt, gen, 0, 1)
    lid = lease["lease_id"]
    leases_path = f"/v1/sinks/{SINK}/checkpoints/0/attempts/{attempt}/leases"
    before = coordinator.snapshot()

    def post(path: str, body: Any, client: ProtocolClient = w) -> httpx.Response:
        return client.request("POST", path, body, expect=None)

    # path parameters
    assert "batch_id" in invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/-1/begin", {"generation": gen}))
    assert "attempt" in invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/attempts/0/leases",
                                            {"generation": gen, "partition": 0, "task_attempt_id": 1}))
    # bodies
    assert invalid_fields(post(leases_path, {"generation": gen, "partition": -1, "task_attempt_id": 1})) == ["partition"]
    assert invalid_fields(post(leases_path, {"generation": gen, "partition": 0})) == ["task_attempt_id"]
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/begin", {"generation": gen, "attempt": 1})) == ["attempt"]
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/begin", {"generation": 0})) == ["generation"]
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/begin", None)) != []
    assert invalid_fields(w.start_generation(SINK, "query 1/../x", "run-1", expect=None)) == ["query_id"]
    assert invalid_fields(w.precommit(SINK, lid, gen, producer_id=1, producer_epoch=32768, expect=None)) == ["producer_epoch"]
    assert invalid_fields(w.precommit(SINK, lid, gen, producer_id=1, records=0, expect=None)) == ["records"]
    assert invalid_fields(w.precommit(SINK, lid, gen, producer_id=-1, expect=None)) == ["producer_id"]
    # the service's own validation answers in the same shape
    assert invalid_fields(w.lease(SINK, 0, attempt, gen, partition=256, task_attempt_id=1, expect=None)) == ["partition"]
    w.precommit(SINK, lid, gen, producer_id=1)
    for bad in ({0: lid, 2: None}, {1: lid}):
        assert invalid_fields(w.commit(SINK, 0, attempt, gen, bad, expect=None)) == ["partitions"]
    dup = {"generation": gen, "partitions": [{"partition": 0, "lease_id": lid}, {"partition": 0, "lease_id": None}]}
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/attempts/{attempt}/commit", dup)) == ["partitions"]
    # sink registration (admin)
    assert invalid_fields(admin.register_sink("s2", "bad prefix/1", expect=None)) == ["transactional_id_prefix"]
    assert invalid_fields(admin.register_sink("s2", "s2-tx\n", expect=None)) == ["transactional_id_prefix"]
    assert invalid_fields(admin.register_sink("s2", "s2-tx", transaction_timeout_ms=900_001, expect=None)) == [
        "transaction_timeout_ms"
    ]
    assert invalid_fields(admin.register_sink("s2", "s2-tx", transaction_timeout_ms=10_000, commit_margin_ms=10_000,
                                              expect=None)) == ["commit_margin_ms"]
    assert invalid_fields(admin.register_sink("-bad name", "s2-tx", expect=None)) == ["name"]
    assert invalid_fields(admin.register_sink("s2\n", "s2-tx", expect=None)) == ["name"]
    assert invalid_fields(admin.register_sink("s2", "s2-tx", colour="blue", expect=None)) == ["colour"]

    after = coordinator.snapshot()
    # only the valid precommit changed anything
    assert [x.state for x in after.leases] == ["PRECOMMITTED"]
    assert (after.sinks, after.checkpoints, after.attempts) == (before.sinks, before.checkpoints, before.attempts)


def test_timeout_above_broker_max_is_explained(admin: ProtocolClient) -> None:
    resp = admin.register_sink("s2", "s2-tx", transaction_timeout_ms=3_600_000, expect=None)
    err = error_of(resp, 422, "transaction_timeout_above_broker_max")
    assert "transaction.max.timeout.ms=900000" in err["message"]
    assert [s["name"] for s in admin.request("GET", "/v1/sinks")] == []


# --- retries answer the same -------------------------------------------------------------------


def test_same_request_same_answer(admin: ProtocolClient, coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    first = admin.register_sink(SINK, PREFIX, expect=201)
    assert admin.register_sink(SINK, PREFIX, expect=200) == first
    w = admin.with_token(first["writer_token"])

    g = w.start_generation(SINK, "query-1", "run-1")
    assert w.start_generation(SINK, "query-1", "run-1") == g
    gen = g["generation"]

    b = w.begin(SINK, 0, gen)
    assert w.begin(SINK, 0, gen) == b

    l0 = w.lease(SINK, 0, 1, gen, 0, 10)
    assert w.lease(SINK, 0, 1, gen, 0, 10) == l0
    l0s = w.lease(SINK, 0, 1, gen, 0, 11)  # a speculative copy: another task attempt, another lease
    assert l0s["lease_id"] != l0["lease_id"] and l0s["transactional_id"] != l0["transactional_id"]
    l1 = w.lease(SINK, 0, 1, gen, 1, 12)

    p = w.precommit(SINK, l0["lease_id"], gen, producer_id=5, producer_epoch=2, records=7, bytes=70)
    assert w.precommit(SINK, l0["lease_id"], gen, producer_id=5, producer_epoch=2, records=7, bytes=70) == p
    w.precommit(SINK, l0s["lease_id"], gen, producer_id=6, producer_epoch=0, records=7, bytes=70)
    w.precommit(SINK, l1["lease_id"], gen, producer_id=8)
    # the lease call retried after the pre-commit still answers with the lease
    assert w.lease(SINK, 0, 1, gen, 0, 10)["lease_id"] == l0["lease_id"]

    winners = {0: l0["lease_id"], 1: l1["lease_id"]}
    c = w.commit(SINK, 0, 1, gen, winners)
    assert c["state"] == "COMMITTED"
    assert w.commit(SINK, 0, 1, gen, winners) == c
    # the retry had no second effect on Kafka
    assert len(kafka.commits) == 2 and len(kafka.aborts) == 1
    # a retry naming other winners is refused, not re-decided
    error_of(w.commit(SINK, 0, 1, gen, {0: l0s["lease_id"], 1: l1["lease_id"]}, expect=None), 409, "winner_mismatch")
    assert check_invariants(coordinator.snapshot(), settled=True) == []


# --- service endpoints -------------------------------------------------------------------------


def test_openapi_lists_the_v1_routes(http: TestClient) -> None:
    spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    expected = {
        "/v1/sinks": {"get", "post"},
        "/v1/sinks/{name}": {"get"},
        "/v1/sinks/{name}/writer-token": {"post"},
        "/v1/sinks/{name}/generations": {"post"},
        "/v1/sinks/{name}/lineage/reset": {"post"},
        "/v1/sinks/{name}/checkpoints": {"get"},
        "/v1/sinks/{name}/checkpoints/{batch_id}": {"get"},
        "/v1/sinks/{name}/checkpoints/{batch_id}/begin": {"post"},
        "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/leases": {"post"},
        "/v1/sinks/{name}/leases/{lease_id}/precommit": {"post"},
        "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/commit": {"post"},
        "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/abort": {"post"},
        "/v1/sinks/{name}/checkpoints/{batch_id}/resume": {"post"},
        "/v1/sinks/{name}/transactions/open": {"get"},
        "/v1/sinks/{name}/events": {"get"},
        "/healthz": {"get"},
        "/readyz": {"get"},
    }
    for path, methods in expected.items():
        assert path in paths, f"{path} missing from OpenAPI"
        assert methods <= set(paths[path]), (path, set(paths[path]))
    commit = paths["/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}/commit"]["post"]
    assert {"401", "403", "404", "409", "422"} <= set(commit["responses"])


def test_readyz(http: TestClient) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    resp = http.get("/readyz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ready", "kafka_control_plane": "none"}


def test_readyz_and_commit_without_database_or_control_plane(database_url: str) -> None:
    # a database that does not answer: not ready
    dead = Coordinator(make_engine("postgresql://nobody@127.0.0.1:1/nothing", pool_size=1), None)
    try:
        with TestClient(create_app(dead, admin_token=ADMIN, token_secret=SECRET)) as client:
            error_of(client.get("/readyz"), 503, "database_unavailable")
            assert client.get("/healthz").status_code == 200
    finally:
        dead.close()
    # a live database but no Kafka control plane: ready, and commits are refused without a decision
    engine = make_engine(database_url, pool_size=2)
    unconfigured = Coordinator(engine, None)
    try:
        with TestClient(create_app(unconfigured, admin_token=ADMIN, token_secret=SECRET)) as client:
            assert client.get("/readyz").json() == {"status": "ready", "kafka_control_plane": "unconfigured"}
            w, gen, attempt = setup_attempt(ProtocolClient(client, ADMIN))
            lease = w.lease(SINK, 0, attempt, gen, 0, 1)
            w.precommit(SINK, lease["lease_id"], gen, producer_id=1)
            resp = w.commit(SINK, 0, attempt, gen, {0: lease["lease_id"]}, expect=None)
            error_of(resp, 503, "kafka_control_plane_unconfigured")
            assert w.checkpoint(SINK, 0)["checkpoint"]["state"] == "OPEN"
    finally:
        unconfigured.close()
        engine.dispose()


# --- broker checks at registration --------------------------------------------------------------


def test_registration_is_refused_when_the_broker_fails_its_checks(
    admin: ProtocolClient, coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    from coordinator.kafka.control_plane import BrokerCheck

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
