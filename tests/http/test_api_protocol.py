"""The protocol's calls over HTTP in-process (routes/protocol.py): FastAPI's TestClient over
`create_app` on a real, freshly migrated Postgres (record-only Kafka control plane, manual clock).

The whole cycle (generation, begin with pre-leases, each try's lease, the commit carrying the
winners' records), retries answering the same, the 409s of stale and contradicting calls (which
change nothing), and the 422s naming the field."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import httpx

from coordinator.kafka.control_plane import PreparedTransaction, RecordingControlPlane
from coordinator.protocol.invariants import check_invariants, check_unchanged
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.api_app import (  # noqa: F401 - fixtures
    PREFIX,
    SINK,
    admin,
    error_of,
    http,
    invalid_fields,
    setup_attempt,
    setup_sink,
    written,
)
from fixtures.servers import ProtocolClient, Winner

COMMIT = f"/v1/sinks/{SINK}/checkpoints/0/attempts/{{attempt}}/commit"


# --- the whole cycle -------------------------------------------------------------------------


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

    begun = w.begin(SINK, 0, gen, offsets="sha256:b0")
    assert begun == {
        "action": "write", "batch_id": 0, "state": "OPEN", "attempt": 1,
        "resumed": False, "aborted": [], "abort_pending": [],
        "pre_leased": 0,  # no partition count given: every try gets its own id
        "commit_margin_ms": 12000, "max_lease_init_age_ms": 30000,
        "producer_init_timeout_ms": 60000, "producer_request_timeout_ms": 60000,
    }

    # partition 0: one task; partition 1: a task and its speculative copy; partition 2: empty
    l0, r0 = written(w, SINK, 0, 1, gen, 0, 100, producer_id=7000, producer_epoch=3, records=5, bytes=500)
    l1, _ = written(w, SINK, 0, 1, gen, 1, 101, producer_id=7001)
    l1s, r1s = written(w, SINK, 0, 1, gen, 1, 201, producer_id=7002, producer_epoch=1, records=2, bytes=20)
    assert {x["transactional_id"] for x in (l0, l1, l1s)} == {f"{PREFIX}-0", f"{PREFIX}-1", f"{PREFIX}-2"}
    for lease, task in ((l0, 100), (l1, 101), (l1s, 201)):
        assert lease["state"] == "LEASED" and lease["attempt"] == 1 and lease["task_attempt_id"] == task
        assert lease["transaction_timeout_ms"] == 120_000 and lease["age_ms"] == 0
        assert (lease["commit_margin_ms"], lease["max_lease_init_age_ms"]) == (12_000, 30_000)
        assert lease["producer_id"] is None and lease["records"] is None  # the record comes with the commit

    done = w.commit(SINK, 0, 1, gen, {0: r0, 1: r1s, 2: None})
    assert done["state"] == "COMMITTED" and done["batch_id"] == 0 and done["attempt"] == 1
    assert [(c["partition"], c["lease_id"], c["producer_id"], c["producer_epoch"], c["records"])
            for c in done["committed"]] == [(0, l0["lease_id"], 7000, 3, 5), (1, l1s["lease_id"], 7002, 1, 2)]
    assert done["aborted"] == [l1["transactional_id"]] and done["abort_pending"] == []
    # Kafka was asked to commit exactly the winners by their records, and to abort the loser
    assert sorted(kafka.commits, key=lambda c: c[1].producer_id) == [
        (SINK, PreparedTransaction(l0["transactional_id"], 7000, 3)),
        (SINK, PreparedTransaction(l1s["transactional_id"], 7002, 1)),
    ]
    assert kafka.aborts == [(SINK, l1["transactional_id"])]

    # a replay of the batch after the commit skips writing
    again = w.begin(SINK, 0, gen, offsets="sha256:b0")
    assert again["action"] == "skip" and again["state"] == "COMMITTED" and again["attempt"] is None

    detail = w.checkpoint(SINK, 0)
    assert detail["checkpoint"]["state"] == "COMMITTED" and detail["checkpoint"]["committed_attempt"] == 1
    assert [a["state"] for a in detail["attempts"]] == ["COMMITTED"]
    assert detail["attempts"][0]["partitions"] == 3
    states = {x["lease_id"]: (x["state"], x["producer_id"]) for x in detail["leases"]}
    assert states == {l0["lease_id"]: ("COMMITTED", 7000), l1["lease_id"]: ("ABORTED", None),
                      l1s["lease_id"]: ("COMMITTED", 7002)}
    assert w.request("GET", f"/v1/sinks/{SINK}/transactions/open") == []
    assert [c["batch_id"] for c in w.request("GET", f"/v1/sinks/{SINK}/checkpoints")] == [0]
    kinds = [ev["kind"] for ev in w.request("GET", f"/v1/sinks/{SINK}/events")]
    for kind in ("sink_registered", "generation_started", "commit_decided"):
        assert kind in kinds
    # one event per batch (its decision); the attempt and checkpoint rows above record begin and commit
    trail = w.request("GET", f"/v1/sinks/{SINK}/events", params={"batch_id": 0})
    assert [(ev["kind"], ev["batch_id"]) for ev in trail] == [("commit_decided", 0)]
    assert detail["attempts"][0]["started_at"] and detail["checkpoint"]["committed_at"]

    # the next batch reuses the pool: the winners' ids are free at once, the loser's is quarantined
    b1 = w.begin(SINK, 1, gen)
    assert b1["action"] == "write" and b1["attempt"] == 1
    lease, record = written(w, SINK, 1, 1, gen, 0, 300)
    assert lease["transactional_id"] == f"{PREFIX}-0"
    other, _ = written(w, SINK, 1, 1, gen, 1, 301)
    assert other["transactional_id"] == f"{PREFIX}-2"  # not -1: a loser's id waits out its quarantine
    assert w.commit(SINK, 1, 1, gen, {0: record, 1: None})["state"] == "COMMITTED"
    assert [c["batch_id"] for c in w.request("GET", f"/v1/sinks/{SINK}/checkpoints")] == [1, 0]

    snap = coordinator.snapshot()
    assert coordinator.pool_usage(SINK).size == 3
    assert sorted(q.ordinal for q in snap.quarantines) == [1, 2]  # both losers' ids
    assert check_invariants(snap, settled=True) == []


def test_pre_leases_are_claimed_by_the_first_try_of_each_partition(
    admin: ProtocolClient, coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
) -> None:
    """begin with the partition count takes one id per partition; the first try to ask claims its
    partition's pre-lease (its lease from then on, aged from the claim), the same try asking again
    gets the same lease, any other try a fresh id. At the commit a pre-lease no try claimed is
    freed at once (no Kafka call, no quarantine)."""
    w, gen, attempt = setup_attempt(admin, partitions=3)
    assert w.begin(SINK, 0, gen, partitions=3)["attempt"] == attempt  # a retry takes no more ids
    detail = w.checkpoint(SINK, 0)
    assert detail["lease_counts"] == {"PRELEASED": 3}
    pre = {x["partition"]: x for x in detail["leases"]}
    assert all(x["task_attempt_id"] is None for x in pre.values())

    clock.advance(seconds=5)
    first, record = written(w, SINK, 0, attempt, gen, 0, 10)
    assert (first["lease_id"], first["transactional_id"]) == (pre[0]["lease_id"], pre[0]["transactional_id"])
    assert first["state"] == "LEASED" and first["task_attempt_id"] == 10 and first["age_ms"] == 0
    # the transaction's clock starts at the claim
    assert datetime.fromisoformat(first["leased_at"]) - datetime.fromisoformat(pre[0]["leased_at"]) == timedelta(seconds=5)
    clock.advance(seconds=1)
    assert w.lease(SINK, 0, attempt, gen, 0, 10)["lease_id"] == first["lease_id"]  # a retried request
    retry, retry_record = written(w, SINK, 0, attempt, gen, 0, 11)  # another try of partition 0
    assert retry["lease_id"] not in {x["lease_id"] for x in pre.values()}
    assert retry["transactional_id"] not in {x["transactional_id"] for x in pre.values()}
    second, record1 = written(w, SINK, 0, attempt, gen, 1, 12)
    assert second["lease_id"] == pre[1]["lease_id"]
    # partition 2 never had a try: its pre-lease is unclaimed

    done = w.commit(SINK, 0, attempt, gen, {0: retry_record, 1: record1, 2: None})
    assert done["state"] == "COMMITTED"
    assert {c["partition"]: c["lease_id"] for c in done["committed"]} == {0: retry["lease_id"], 1: second["lease_id"]}
    assert done["aborted"] == [first["transactional_id"]]  # the claimed pre-lease lost: aborted on Kafka
    assert kafka.aborts == [(SINK, first["transactional_id"])]  # nothing for the unclaimed one
    leases = {x["lease_id"]: x["state"] for x in w.checkpoint(SINK, 0)["leases"]}
    assert leases[pre[2]["lease_id"]] == "ABORTED" and leases[first["lease_id"]] == "ABORTED"
    quarantined = {q.ordinal for q in coordinator.snapshot().quarantines}
    assert quarantined == {int(first["transactional_id"].rsplit("-", 1)[1])}  # not partition 2's id
    assert check_invariants(coordinator.snapshot(), settled=True) == []


def test_a_record_names_the_try_that_holds_the_lease(admin: ProtocolClient, coordinator: Coordinator) -> None:
    """A winner's record comes from the try that claimed its lease (issue 50 §2): a record from
    another try, or for a pre-lease no try claimed, is refused (409 lease_not_claimed), and
    neither refusal changes anything."""
    w, gen, attempt = setup_attempt(admin, partitions=2)
    lease, record = written(w, SINK, 0, attempt, gen, 0, 10)
    pre1 = next(x for x in w.checkpoint(SINK, 0)["leases"] if x["partition"] == 1)
    before = coordinator.snapshot()

    other_try = Winner(record.lease_id, 99, record.producer_id)
    err = error_of(w.commit(SINK, 0, attempt, gen, {0: other_try, 1: None}, expect=None), 409, "lease_not_claimed")
    assert err["detail"] == {"lease_id": lease["lease_id"], "holder": 10, "reported_by": 99}
    unclaimed = Winner(pre1["lease_id"], 11, 5)
    err = error_of(w.commit(SINK, 0, attempt, gen, {0: record, 1: unclaimed}, expect=None), 409, "lease_not_claimed")
    assert err["detail"] == {"lease_id": pre1["lease_id"], "holder": None, "reported_by": 11}
    assert check_unchanged(before, coordinator.snapshot()) == []
    assert w.commit(SINK, 0, attempt, gen, {0: record, 1: None})["state"] == "COMMITTED"


def test_batch_figures_are_stored_and_read_back(admin: ProtocolClient) -> None:
    """Per-batch figures for operators: the executor's write time comes with its record and is
    kept on the lease, the driver's job time comes with the commit and is kept on the attempt;
    both are optional, and a retried commit with another write time is still the same commit."""
    w, gen, attempt = setup_attempt(admin)
    _, r0 = written(w, SINK, 0, attempt, gen, 0, 1, producer_id=51, records=4, bytes=40, write_ms=37)
    _, r1 = written(w, SINK, 0, attempt, gen, 1, 2, producer_id=52)  # no write time: optional
    bad = w.commit(SINK, 0, attempt, gen, {0: Winner(r0.lease_id, 1, 51, write_ms=-1), 1: r1}, expect=None)
    assert invalid_fields(bad) == ["partitions.0.write_ms"]
    done = w.commit(SINK, 0, attempt, gen, {0: r0, 1: r1}, job_ms=1234)
    assert done["state"] == "COMMITTED"
    again = w.commit(SINK, 0, attempt, gen, {0: Winner(r0.lease_id, 1, 51, records=4, bytes=40, write_ms=99), 1: r1},
                     job_ms=9)
    assert again == done
    detail = w.checkpoint(SINK, 0)
    assert [a["job_ms"] for a in detail["attempts"]] == [1234]
    assert {x["partition"]: (x["records"], x["bytes"], x["write_ms"]) for x in detail["leases"]} == {
        0: (4, 40, 37), 1: (10, 1000, None)}
    assert (detail["records"], detail["bytes"]) == (14, 1040)


def test_abort_by_driver_then_new_attempt(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen, attempt = setup_attempt(admin)
    l0 = w.lease(SINK, 0, attempt, gen, partition=0, task_attempt_id=1)
    out = w.abort(SINK, 0, attempt, gen, reason="job failed")
    assert out["attempt"]["state"] == "ABORTED" and out["attempt"]["abort_reason"] == "job failed"
    assert out["aborted"] == [l0["transactional_id"]]
    assert w.abort(SINK, 0, attempt, gen, reason="job failed") == out  # a retry answers the same
    # a writer must name its generation to abort
    error_of(w.abort(SINK, 0, attempt, None, expect=None), 422, "generation_required")
    begun = w.begin(SINK, 0, gen)
    assert begun["attempt"] == 2 and begun["action"] == "write"
    assert begun["aborted"] == [l0["transactional_id"]]
    assert check_invariants(coordinator.snapshot(), settled=True) == []


# --- retries answer the same -------------------------------------------------------------------


def test_same_request_same_answer(admin: ProtocolClient, coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    first = admin.register_sink(SINK, PREFIX, expect=201)
    assert admin.register_sink(SINK, PREFIX, expect=200) == first
    w = admin.with_token(first["writer_token"])

    g = w.start_generation(SINK, "query-1", "run-1")
    assert w.start_generation(SINK, "query-1", "run-1") == g
    gen = g["generation"]

    b = w.begin(SINK, 0, gen, partitions=2)
    assert w.begin(SINK, 0, gen, partitions=2) == b

    l0, r0 = written(w, SINK, 0, 1, gen, 0, 10, producer_id=5, producer_epoch=2, records=7, bytes=70)
    assert w.lease(SINK, 0, 1, gen, 0, 10) == l0
    l0s, r0s = written(w, SINK, 0, 1, gen, 0, 11, producer_id=6)  # a speculative copy: another lease
    assert l0s["lease_id"] != l0["lease_id"] and l0s["transactional_id"] != l0["transactional_id"]
    _, r1 = written(w, SINK, 0, 1, gen, 1, 12, producer_id=8)

    winners: dict[int, Winner | None] = {0: r0, 1: r1}
    c = w.commit(SINK, 0, 1, gen, winners)
    assert c["state"] == "COMMITTED"
    assert w.commit(SINK, 0, 1, gen, winners) == c
    # the retry had no second effect on Kafka
    assert len(kafka.commits) == 2 and kafka.aborts == [(SINK, l0s["transactional_id"])]
    # a retry naming other winners, or other records, is refused, not re-decided
    error_of(w.commit(SINK, 0, 1, gen, {0: r0s, 1: r1}, expect=None), 409, "winner_mismatch")
    changed = Winner(r0.lease_id, 10, 5, producer_epoch=3, records=7, bytes=70)
    error_of(w.commit(SINK, 0, 1, gen, {0: changed, 1: r1}, expect=None), 409, "winner_mismatch")
    # a try's lease asked again after the decision is no longer live
    error_of(w.lease(SINK, 0, 1, gen, 0, 10, expect=None), 409, "stale_lease")
    assert check_invariants(coordinator.snapshot(), settled=True) == []


# --- 409: stale and contradicting calls change nothing -------------------------------------------


def test_409_stale_generation(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen1, attempt = setup_attempt(admin, partitions=2)
    lease, record = written(w, SINK, 0, attempt, gen1, 0, 1)
    # the query restarts: a new driver fences the old one and its open attempt
    g2 = w.start_generation(SINK, "query-1", "run-2")
    assert g2["generation"] == gen1 + 1 and g2["aborted"] == [lease["transactional_id"]]

    before = coordinator.snapshot()
    for resp in (
        w.begin(SINK, 0, gen1, expect=None),
        w.begin(SINK, 1, gen1, partitions=2, expect=None),
        w.lease(SINK, 0, attempt, gen1, 1, 2, expect=None),
        w.lease(SINK, 0, attempt, gen1, 0, 1, expect=None),  # the fenced try asking again
        w.commit(SINK, 0, attempt, gen1, {0: record, 1: None}, expect=None),
        w.abort(SINK, 0, attempt, gen1, expect=None),
        w.start_generation(SINK, "query-1", "run-1", expect=None),  # the old driver retrying its start
    ):
        err = error_of(resp, 409, "stale_generation")
        assert err["detail"]["current_generation"] == g2["generation"]
    error_of(w.begin(SINK, 0, g2["generation"] + 1, expect=None), 409, "unknown_generation")
    assert check_unchanged(before, coordinator.snapshot()) == []  # I5


def test_409_superseded_attempt(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen, _ = setup_attempt(admin)
    old, old_record = written(w, SINK, 0, 1, gen, 0, 1)
    # batch 1 begins (batch 0's attempt 1 is dead), then batch 0 is retried under attempt 2
    w.begin(SINK, 1, gen)
    b0 = w.begin(SINK, 0, gen)
    assert b0["attempt"] == 2 and b0["aborted"] == [old["transactional_id"]]

    before = coordinator.snapshot()
    err = error_of(w.lease(SINK, 0, 1, gen, 1, 5, expect=None), 409, "stale_attempt")
    assert err["detail"]["current_attempt"] == 2
    error_of(w.commit(SINK, 0, 1, gen, {0: old_record}, expect=None), 409, "stale_attempt")
    # the superseded attempt's lease itself is no longer live
    error_of(w.lease(SINK, 0, 1, gen, 0, 1, expect=None), 409, "stale_lease")
    # and a winner of the old attempt cannot be named by the new one
    error_of(w.commit(SINK, 0, 2, gen, {0: old_record}, expect=None), 409, "stale_lease")
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
    error_of(w.begin(SINK, 0, reset["generation"], expect=None), 409, "lineage_not_bound")
    g = w.start_generation(SINK, "query-2", "run-9")
    assert g["generation"] == gen1 + 2
    error_of(w.begin(SINK, 0, gen1, expect=None), 409, "stale_generation")
    assert w.begin(SINK, 0, g["generation"])["action"] == "write"


def test_409_other_conflicts(admin: ProtocolClient, coordinator: Coordinator, clock: ManualClock) -> None:
    w, gen, attempt = setup_attempt(admin)
    # a sink name with another configuration, a prefix overlapping another sink's
    err = error_of(admin.register_sink(SINK, "elsewhere", expect=None), 409, "sink_exists")
    assert err["detail"]["existing"]["transactional_id_prefix"] == PREFIX
    error_of(admin.register_sink("orders2", PREFIX + "-x", expect=None), 409, "transactional_id_prefix_clash")
    error_of(admin.register_sink("orders3", "orders", expect=None), 409, "transactional_id_prefix_clash")

    a, ra = written(w, SINK, 0, attempt, gen, 0, 1)
    b, rb = written(w, SINK, 0, attempt, gen, 1, 2)
    error_of(w.commit(SINK, 0, attempt, gen, {0: rb, 1: ra}, expect=None), 409, "lease_mismatch")

    # the timeout gate: 55 s into a 60 s transaction is inside the 6 s margin
    clock.advance(seconds=55)
    err = error_of(w.commit(SINK, 0, attempt, gen, {0: ra, 1: None}, expect=None), 409, "transaction_deadline_too_close")
    assert err["detail"]["lease_ids"] == [a["lease_id"]] and err["detail"]["margin_ms"] == 6000
    # the refusal aborted the attempt; a retry is refused the same way and a replay starts afresh
    error_of(w.commit(SINK, 0, attempt, gen, {0: ra, 1: None}, expect=None), 409, "transaction_deadline_too_close")
    assert w.checkpoint(SINK, 0)["attempts"][0]["state"] == "ABORTED"
    assert w.begin(SINK, 0, gen)["attempt"] == attempt + 1
    assert check_invariants(coordinator.snapshot(), settled=True) == []


# --- 404 -------------------------------------------------------------------------------------


def test_404_for_unknown_sink_checkpoint_attempt(admin: ProtocolClient) -> None:
    w, gen, attempt = setup_attempt(admin)
    error_of(admin.request("GET", "/v1/sinks/no-such-sink", expect=None), 404, "unknown_sink")
    error_of(admin.begin("no-such-sink", 0, 1, expect=None), 404, "unknown_sink")
    error_of(admin.rotate_writer_token("no-such-sink", expect=None), 404, "unknown_sink")

    err = error_of(w.checkpoint(SINK, 42, expect=None), 404, "unknown_checkpoint")
    assert err["detail"]["batch_id"] == 42
    error_of(w.lease(SINK, 42, 1, gen, 0, 1, expect=None), 404, "unknown_checkpoint")
    error_of(w.lease(SINK, 0, 9, gen, 0, 1, expect=None), 404, "unknown_attempt")
    error_of(w.commit(SINK, 0, 9, gen, {0: None}, expect=None), 404, "unknown_attempt")

    # a lease id of another sink is no lease of this attempt (admin token: no auth short-cut)
    other = setup_sink(admin, "other", "other-tx")
    og = other.start_generation("other", "qo", "ro")["generation"]
    other.begin("other", 0, og)
    _, foreign = written(other, "other", 0, 1, og, 0, 1)
    error_of(admin.commit(SINK, 0, attempt, gen, {0: foreign}, expect=None), 409, "stale_lease")


# --- 422 -------------------------------------------------------------------------------------


def test_422_names_the_field(admin: ProtocolClient, coordinator: Coordinator) -> None:
    w, gen, attempt = setup_attempt(admin)
    lease, record = written(w, SINK, 0, attempt, gen, 0, 1)
    leases_path = f"/v1/sinks/{SINK}/checkpoints/0/attempts/{attempt}/leases"
    commit_path = COMMIT.format(attempt=attempt)
    before = coordinator.snapshot()

    def post(path: str, body: Any) -> httpx.Response:
        return w.request("POST", path, body, expect=None)  # type: ignore[no-any-return]

    def commit_with(**change: Any) -> httpx.Response:
        return post(commit_path, {"generation": gen, "partitions": [{**record.body(0), **change}]})

    # path parameters
    assert "batch_id" in invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/-1/begin", {"generation": gen}))
    assert "attempt" in invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/attempts/0/leases",
                                            {"generation": gen, "partition": 0, "task_attempt_id": 1}))
    # bodies
    assert invalid_fields(post(leases_path, {"generation": gen, "partition": -1, "task_attempt_id": 1})) == ["partition"]
    assert invalid_fields(post(leases_path, {"generation": gen, "partition": 0})) == ["task_attempt_id"]
    assert invalid_fields(post(leases_path, {"generation": gen, "partition": 0, "task_attempt_id": -1})) == [
        "task_attempt_id"]
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/begin", {"generation": gen, "attempt": 1})) == ["attempt"]
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/begin", {"generation": 0})) == ["generation"]
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/1/begin", {"generation": gen, "partitions": -1})) == [
        "partitions"]
    assert invalid_fields(post(f"/v1/sinks/{SINK}/checkpoints/0/begin", None)) != []
    assert invalid_fields(w.start_generation(SINK, "query 1/../x", "run-1", expect=None)) == ["query_id"]
    assert invalid_fields(commit_with(producer_epoch=32768)) == ["partitions.0.producer_epoch"]
    assert invalid_fields(commit_with(records=0)) == ["partitions.0.records"]
    assert invalid_fields(commit_with(producer_id=-1)) == ["partitions.0.producer_id"]
    assert invalid_fields(commit_with(task_attempt_id=-1)) == ["partitions.0.task_attempt_id"]
    # a winner comes with its whole record; an empty partition with none
    for partial in ({"task_attempt_id": None}, {"bytes": None}):
        assert invalid_fields(commit_with(**partial)) == ["partitions.0"]
    assert invalid_fields(post(commit_path, {"generation": gen, "partitions": [{"partition": 0, "lease_id": lease[
        "lease_id"]}]})) == ["partitions.0"]
    assert invalid_fields(commit_with(lease_id=None)) == ["partitions.0"]
    # the service's own validation answers in the same shape
    assert invalid_fields(w.lease(SINK, 0, attempt, gen, partition=256, task_attempt_id=1, expect=None)) == ["partition"]
    assert invalid_fields(w.begin(SINK, 1, gen, partitions=257, expect=None)) == ["partition"]
    for bad in ({0: record, 2: None}, {1: Winner(record.lease_id, 1, 7000)}):
        assert invalid_fields(w.commit(SINK, 0, attempt, gen, bad, expect=None)) == ["partitions"]
    dup = {"generation": gen, "partitions": [record.body(0), {"partition": 0, "lease_id": None}]}
    assert invalid_fields(post(commit_path, dup)) == ["partitions"]
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

    assert check_unchanged(before, coordinator.snapshot()) == []  # none of it changed anything
    assert [x.state.value for x in coordinator.snapshot().leases] == ["LEASED"]


def test_a_commit_without_a_control_plane_is_refused_before_any_decision(database_url: str) -> None:
    """No Kafka control plane: ready, and a commit is refused (503) with nothing decided."""
    from fastapi.testclient import TestClient

    from coordinator.http.api import create_app
    from coordinator.store.db import make_engine
    from fixtures.api_app import ADMIN, SECRET

    engine = make_engine(database_url, pool_size=2)
    unconfigured = Coordinator(engine, None)
    try:
        with TestClient(create_app(unconfigured, admin_token=ADMIN, token_secret=SECRET)) as client:
            assert client.get("/readyz").json() == {"status": "ready", "kafka_control_plane": "unconfigured"}
            w, gen, attempt = setup_attempt(ProtocolClient(client, ADMIN), partitions=2)
            _, record = written(w, SINK, 0, attempt, gen, 0, 1)
            error_of(w.commit(SINK, 0, attempt, gen, {0: record, 1: None}, expect=None), 503,
                     "kafka_control_plane_unconfigured")
            assert w.checkpoint(SINK, 0)["checkpoint"]["state"] == "OPEN"
            assert check_invariants(unconfigured.snapshot()) == []
    finally:
        unconfigured.close()
        engine.dispose()
