"""Loud failure instead of silent loss: a decided commit that Kafka refuses for good (producer
fenced, transaction timed out, unknown producer id) makes the checkpoint LOST with its reason,
fences the refused id on Kafka before it can be leased again (I3), records a `data_lost` event,
counts it in Prometheus, and halts the sink (begin checkpoint answers 409 sink_halted_lost_data)
until an operator acknowledges through the API. Retriable failures keep the decision pending.

Real Postgres per test, record-only Kafka control plane (its `fail_next` injects the refusals),
manual clock; the HTTP half uses FastAPI's TestClient over the same coordinator."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from coordinator.http.api import create_app
from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane, TransactionOutcome
from coordinator.protocol import errors as e
from coordinator.protocol import rules
from coordinator.protocol.invariants import check_invariants, check_unchanged
from coordinator.protocol.model import Lease
from coordinator.protocol.model import PartitionResult as PR
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState
from coordinator.service import Coordinator, SinkSpec
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import held, quarantined, won
from fixtures.servers import ProtocolClient, Winner

NAME = "payments"
PREFIX = "payments-eos"
ACTOR = "test"
ADMIN = "lost-data-admin-token"
SECRET = b"lost-data-writer-secret"

FENCED = ControlPlaneError("EndTxn: broker answered PRODUCER_FENCED (90)", retriable=False, code="producer_fenced")
UNREACHABLE = ControlPlaneError("broker unreachable", retriable=True, code="network_exception")


def metric(name: str, sink: str = NAME) -> float:
    return REGISTRY.get_sample_value(name, {"sink": sink}) or 0.0


def start(c: Coordinator, name: str = NAME, prefix: str = PREFIX) -> int:
    c.register_sink(SinkSpec(name=name, transactional_id_prefix=prefix, bootstrap_servers="kafka:9092",
                             topics=["out"]), ACTOR)
    gen, _ = c.start_generation(name, "query-1", "run-1", ACTOR)
    return gen


def write_batch(c: Coordinator, gen: int, batch: int, partitions: int, name: str = NAME) -> tuple[int, list[Lease]]:
    """Begin the batch and have each partition's first try claim its pre-lease (and write)."""
    begun = c.begin_checkpoint(name, batch, gen, ACTOR, partitions=partitions)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.attempt is not None
    winners = [c.lease(name, batch, begun.attempt.number, gen, p, 100 + p).lease for p in range(partitions)]
    return begun.attempt.number, winners


def results(winners: list[Lease], first_offsets: dict[int, list[list[Any]]] | None = None) -> list[PR]:
    """Each winner with the record its try reported (producer 1000 + lease id, epoch 3, 10 records)."""
    return [won(w, epoch=3, first_offsets=(first_offsets or {}).get(w.id)) for w in winners]


def leases_by_id(c: Coordinator) -> dict[int, Lease]:
    return {x.id: x for x in c.snapshot().leases}


def events(c: Coordinator, kind: str, name: str = NAME) -> list[dict[str, Any]]:
    return [ev for ev in c.list_events(name, limit=1000) if ev["kind"] == kind]


def assert_invariants(c: Coordinator, *, settled: bool = True) -> None:
    violations = check_invariants(c.snapshot(), settled=settled)
    assert violations == [], [str(v) for v in violations]


def refused(c: Coordinator, kafka: RecordingControlPlane, call: Any, reason: str) -> e.Conflict:
    """Refused with `reason`, and nothing changed: durable state, alerts, Kafka."""
    before, calls = c.snapshot(), (len(kafka.commits), len(kafka.aborts))
    with pytest.raises(e.Conflict) as exc:
        call()
    assert exc.value.reason == reason, exc.value.to_dict()
    assert check_unchanged(before, c.snapshot()) == []
    assert (len(kafka.commits), len(kafka.aborts)) == calls
    return exc.value


# --- the service -----------------------------------------------------------------------------


def test_refused_commit_is_lost_loudly_and_halts_the_sink(coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    c = coordinator
    gen = start(c)
    attempt, winners = write_batch(c, gen, 0, 2)
    lost_before, lost_txn_before = metric("coordinator_checkpoints_lost_total"), metric("coordinator_transactions_lost_total")
    kafka.fail_next(FENCED)  # whichever winner's EndTxn goes first is refused for good

    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, attempt, gen, results(winners), ACTOR)

    assert exc.value.reason == e.DATA_LOST and "producer_fenced" in exc.value.message
    committed_tid = {t.transactional_id for _, t in kafka.commits}
    (refused_w,) = [w for w in winners if w.transactional_id not in committed_tid]
    (other,) = [w for w in winners if w.transactional_id in committed_tid]
    snap = c.snapshot()
    (cp,) = snap.checkpoints
    assert cp.state is CheckpointState.LOST and cp.lost_at is not None
    assert f"partition {refused_w.partition} ({refused_w.transactional_id}" in (cp.lost_reason or "")
    assert "producer_fenced" in (cp.lost_reason or "")
    assert {a.number: a.state for a in snap.attempts} == {attempt: AttemptState.LOST}
    now = leases_by_id(c)
    assert now[refused_w.id].state is LeaseState.LOST and now[refused_w.id].resolved_at is not None
    assert now[other.id].state is LeaseState.COMMITTED  # the other partition's data is delivered
    # the refused id was fenced on Kafka before it was freed (I3), and is quarantined after the fence
    assert (NAME, refused_w.transactional_id) in kafka.aborts
    assert refused_w.transactional_id not in held(c, NAME) and refused_w.ordinal in quarantined(c)
    sink = c.get_sink(NAME)
    assert sink.halted and sink.halted_reason == cp.lost_reason
    (alert,) = events(c, "data_lost")
    assert alert["batch_id"] == 0 and alert["actor"] == "coordinator"
    assert alert["detail"]["lost"][0]["transactional_id"] == refused_w.transactional_id
    assert alert["detail"]["lost"][0]["code"] == "producer_fenced"
    assert alert["detail"]["lost"][0]["records"] == 10
    assert metric("coordinator_checkpoints_lost_total") == lost_before + 1
    assert metric("coordinator_transactions_lost_total") == lost_txn_before + 1
    assert_invariants(c)

    # every retry answers the same, and changes nothing
    refused(c, kafka, lambda: c.commit(NAME, 0, attempt, gen, results(winners), ACTOR), e.DATA_LOST)
    refused(c, kafka, lambda: c.resume(NAME, 0), e.DATA_LOST)
    # the sink refuses every batch until an operator acknowledges
    halted = refused(c, kafka, lambda: c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2), e.SINK_HALTED_LOST_DATA)
    assert f"/v1/sinks/{NAME}/lost-data/acknowledge" in halted.message and "producer_fenced" in halted.message
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, gen, ACTOR), e.SINK_HALTED_LOST_DATA)
    assert metric("coordinator_checkpoints_lost_total") == lost_before + 1  # counted once

    sink, was_halted, lost = c.acknowledge_lost_data(NAME, "admin", "re-delivered batch 0 by hand", "alice")
    assert was_halted and lost == [0] and not sink.halted and sink.halted_reason is None
    (ack,) = events(c, "lost_data_acknowledged")
    assert ack["actor"] == "admin" and ack["detail"]["operator"] == "alice"
    assert ack["detail"]["reason"] == "re-delivered batch 0 by hand" and ack["detail"]["lost_batches"] == [0]
    assert ack["detail"]["halted_reason"] == cp.lost_reason and ack["at"] is not None
    # a retried acknowledgement changes nothing
    before = c.snapshot()
    assert c.acknowledge_lost_data(NAME, "admin", "again")[1:] == (False, [])
    assert before == c.snapshot() and len(events(c, "lost_data_acknowledged")) == 1

    # the lost batch is skipped on replay (rewriting it would duplicate the committed partition)
    replay = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    assert replay.action is BeginAction.SKIP and replay.checkpoint.state is CheckpointState.LOST
    next_attempt, next_winners = write_batch(c, gen, 1, 2)
    done = c.commit(NAME, 1, next_attempt, gen, results(next_winners), ACTOR)
    assert done.checkpoint.state is CheckpointState.COMMITTED
    assert_invariants(c)


def test_a_retired_sinks_halt_and_other_last_seen_gauges_are_dropped(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
) -> None:
    """A halted sink may be retired (nothing of it is open): its halt gauge, read from the
    database at scrape time, goes with it; the last-seen gauges a process keeps (near-timeout,
    LSO lag) are dropped by the process that retires it, and by the recovery leader at its next
    pass when another replica retired it."""
    from sqlalchemy import update

    from coordinator.service import metrics
    from coordinator.service.metrics import DatabaseCollector
    from coordinator.service.recovery import RecoveryLoop
    from coordinator.store.tables import sinks

    c = coordinator
    gen = start(c)
    other = start(c, "gone", "gone-eos")
    attempt, winners = write_batch(c, gen, 0, 1)
    kafka.fail_next(FENCED)
    with pytest.raises(e.Conflict):
        c.commit(NAME, 0, attempt, gen, results(winners), ACTOR)
    c.begin_checkpoint("gone", 0, other, ACTOR, partitions=1)
    c.lease("gone", 0, 1, other, 0, 7)

    def halted_in_database() -> dict[str, float]:
        return {s.labels["sink"]: s.value for m in DatabaseCollector(c.ctx.read, ttl_s=0).collect()
                if m.name == "coordinator_sink_halted" for s in m.samples}

    def near_timeout_gauged() -> set[str]:
        return {s.labels["sink"] for m in REGISTRY.collect() if m.name == "coordinator_transactions_near_timeout"
                for s in m.samples}

    assert halted_in_database() == {NAME: 1, "gone": 0}
    metrics.TRANSACTIONS_NEAR_TIMEOUT.labels(NAME).set(1)  # as this process last saw it
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000)
    try:
        clock.advance(ms=50_000)  # gone's try is past 80 % of its transaction's lifetime
        assert loop.run_once().leader
        assert {NAME, "gone"} <= near_timeout_gauged()
        c.retire_sink(NAME, "admin", "replaced")  # retired here: this process drops its gauges at once
        assert NAME not in near_timeout_gauged() and NAME not in halted_in_database()
        c.abort_attempt("gone", 0, 1, other, "stop", ACTOR)
        with c.engine.begin() as conn:  # retired by another replica: the leader drops them at its next pass
            conn.execute(update(sinks).where(sinks.c.name == "gone").values(retired_at=c.clock.now()))
        assert halted_in_database() == {}
        loop.run_once()
        assert near_timeout_gauged() & {NAME, "gone"} == set()
    finally:
        loop.stop()


def test_retriable_failures_stay_committing_until_a_later_refusal_loses_the_batch(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    c = coordinator
    gen = start(c)
    attempt, (winner,) = write_batch(c, gen, 0, 1)
    kafka.fail_next(UNREACHABLE)
    with pytest.raises(e.Unavailable) as exc:
        c.commit(NAME, 0, attempt, gen, results([winner]), ACTOR)
    assert exc.value.reason == "kafka_commit_failed"
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING
    assert not c.get_sink(NAME).halted and events(c, "data_lost") == []

    # the resume is refused for good (say the broker aborted it at its timeout meanwhile); the
    # fence of the refused id fails too: the id stays held (never re-leased) until it is done
    kafka.fail_next(ControlPlaneError("INVALID_PRODUCER_EPOCH", retriable=False, code="invalid_producer_epoch"))
    kafka.fail_next(UNREACHABLE)  # the fence right after the refusal
    with pytest.raises(e.Conflict) as lost:
        c.resume(NAME, 0)
    assert lost.value.reason == e.DATA_LOST and "invalid_producer_epoch" in lost.value.message
    assert leases_by_id(c)[winner.id].state is LeaseState.LOST_ABORTING
    assert held(c, NAME) == [winner.transactional_id]
    assert c.snapshot().checkpoints[0].state is CheckpointState.LOST and c.get_sink(NAME).halted
    assert_invariants(c, settled=False)
    violations = [str(v) for v in check_invariants(c.snapshot(), settled=True)]
    assert violations and all("not aborted" in v for v in violations)  # the fence is still owed

    # the id is not handed out while it may hold a transaction: a new lease gets another one
    c.acknowledge_lost_data(NAME, "admin", "accepted")
    nxt_attempt, (fresh,) = write_batch(c, gen, 1, 1)
    assert fresh.transactional_id != winner.transactional_id

    out = c.run_pending_aborts(NAME)
    assert out.aborted == [winner.transactional_id] and out.pending == []
    assert leases_by_id(c)[winner.id].state is LeaseState.LOST
    assert winner.transactional_id not in held(c, NAME) and winner.ordinal in quarantined(c)
    assert_invariants(c, settled=False)


def test_one_refused_winner_does_not_stop_the_others(coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    c = coordinator
    gen = start(c)
    attempt, winners = write_batch(c, gen, 0, 3)
    kafka.fail_next(FENCED)
    kafka.fail_next(UNREACHABLE)
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, attempt, gen, results(winners), ACTOR)
    assert exc.value.reason == e.DATA_LOST
    states = {w.id: leases_by_id(c)[w.id].state for w in winners}
    assert sorted(states.values()) == sorted([LeaseState.LOST, LeaseState.COMMITTING, LeaseState.COMMITTED])
    assert c.snapshot().checkpoints[0].state is CheckpointState.LOST
    assert len(events(c, "data_lost")) == 1 and len(events(c, "commit_failed")) == 1
    assert_invariants(c, settled=False)

    # the winner that failed retriably is still committed later (less data lost)
    with pytest.raises(e.Conflict) as again:
        c.resume(NAME, 0)
    assert again.value.reason == e.DATA_LOST
    final = sorted(leases_by_id(c)[w.id].state for w in winners)
    assert final == sorted([LeaseState.LOST, LeaseState.COMMITTED, LeaseState.COMMITTED])
    assert len(kafka.commits) == 2 and len(events(c, "data_lost")) == 1
    assert events(c, "checkpoint_committed") == []  # a LOST checkpoint is never marked committed
    assert_invariants(c)


# --- which refusals end a commit -------------------------------------------------------------


def test_only_refusals_that_mean_the_transaction_is_gone_are_final() -> None:
    # Kafka's TransactionCoordinator.endTransaction answers these when the transaction can never
    # commit; KafkaApis maps PRODUCER_FENCED to INVALID_PRODUCER_EPOCH for EndTxn < v2
    assert rules.TRANSACTION_GONE_CODES == {"producer_fenced", "invalid_producer_epoch",
                                            "invalid_producer_id_mapping", "invalid_txn_state", "unknown_producer_id"}
    for code in ("unknown_server_error", "transactional_id_authorization_failed", "cluster_authorization_failed",
                 "kafka_error_4242", "request_timed_out", "network_exception", "transaction_abortable"):
        assert not ControlPlaneError("x", retriable=False, code=code).transaction_gone, code


@pytest.mark.parametrize("code", ["unknown_server_error", "transactional_id_authorization_failed", "kafka_error_4242"])
def test_an_unexpected_broker_error_keeps_the_commit_decided_and_never_aborts_it(
    coordinator: Coordinator, kafka: RecordingControlPlane, code: str
) -> None:
    c = coordinator
    gen = start(c)
    attempt, winners = write_batch(c, gen, 0, 2)
    kafka.fail_next(ControlPlaneError(f"EndTxn: broker answered {code.upper()}", retriable=False, code=code), times=3)

    with pytest.raises(e.Unavailable) as exc:
        c.commit(NAME, 0, attempt, gen, results(winners), ACTOR)
    assert exc.value.reason == "kafka_commit_failed"
    with pytest.raises(e.Unavailable):  # the next try meets the same answer (say, until the ACL is back)
        c.resume(NAME, 0)
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING
    assert kafka.aborts == []  # the still-committable transactions were not aborted
    assert not c.get_sink(NAME).halted and events(c, "data_lost") == []
    assert code.upper() in str(events(c, "commit_failed")[-1]["detail"])
    assert_invariants(c, settled=False)

    done = c.resume(NAME, 0)  # the broker answers again: the decided commit goes through
    assert done.checkpoint.state is CheckpointState.COMMITTED
    assert {t.transactional_id for _, t in kafka.commits} == {w.transactional_id for w in winners}
    assert_invariants(c)


@pytest.mark.parametrize("code", sorted(rules.TRANSACTION_GONE_CODES))
def test_every_transaction_gone_code_ends_the_commit(coordinator: Coordinator, kafka: RecordingControlPlane,
                                                     code: str) -> None:
    c = coordinator
    gen = start(c)
    attempt, winners = write_batch(c, gen, 0, 1)
    kafka.fail_next(ControlPlaneError(code.upper(), retriable=False, code=code))
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, attempt, gen, results(winners), ACTOR)
    assert exc.value.reason == e.DATA_LOST and code in exc.value.message
    # no first offsets were reported: the loss is declared, but not as established
    assert "NOT verified in the partition log" in exc.value.message


# --- "LOST only when true": the partition log decides ------------------------------------------


def test_a_refused_commit_that_the_log_shows_committed_is_committed_after_all(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    # the EndTxn was applied, its answer lost, the id initialised again: the retry is fenced
    c = coordinator
    gen = start(c)
    attempt, (winner,) = write_batch(c, gen, 0, 1)
    kafka.outcomes[winner.transactional_id] = TransactionOutcome.COMMITTED
    kafka.fail_next(FENCED)

    done = c.commit(NAME, 0, attempt, gen, results([winner], {winner.id: [["out", 0, 17], ["out", 2, 4]]}), ACTOR)
    assert done.checkpoint.state is CheckpointState.COMMITTED
    assert kafka.outcome_reads == [(winner.transactional_id, (("out", 0, 17), ("out", 2, 4)))]
    assert leases_by_id(c)[winner.id].state is LeaseState.COMMITTED
    (ev,) = events(c, "committed_after_all")
    assert ev["detail"]["transactional_ids"] == [winner.transactional_id] and ev["detail"]["codes"] == ["producer_fenced"]
    assert events(c, "data_lost") == [] and not c.get_sink(NAME).halted
    # committed by the call that decided: committed_after_all is its story, no committed mark event
    assert events(c, "checkpoint_committed") == []
    assert kafka.aborts == []
    assert_invariants(c)


def test_a_refused_commit_is_lost_when_the_log_shows_it_aborted_and_waits_while_it_cannot_tell(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    c = coordinator
    gen = start(c)
    attempt, (winner,) = write_batch(c, gen, 0, 1)
    kafka.fail_next(FENCED)  # the log cannot tell yet (the abort markers are still being written)
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, attempt, gen, results([winner], {winner.id: [["out", 1, 3]]}), ACTOR)
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING and not c.get_sink(NAME).halted

    kafka.outcomes[winner.transactional_id] = TransactionOutcome.ABORTED
    kafka.fail_next(FENCED)
    with pytest.raises(e.Conflict) as exc:
        c.resume(NAME, 0)
    assert exc.value.reason == e.DATA_LOST and "loss confirmed in the partition log" in exc.value.message
    halted = refused(c, kafka, lambda: c.begin_checkpoint(NAME, 1, gen, ACTOR), e.SINK_HALTED_LOST_DATA)
    assert "loss confirmed" in halted.message
    assert_invariants(c)


def test_the_halt_message_asks_to_check_the_log_before_re_delivering_an_unverified_loss(
    coordinator: Coordinator, kafka: RecordingControlPlane
) -> None:
    c = coordinator
    gen = start(c)
    attempt, winners = write_batch(c, gen, 0, 1)
    kafka.fail_next(FENCED)
    with pytest.raises(e.Conflict):
        c.commit(NAME, 0, attempt, gen, results(winners), ACTOR)
    halted = refused(c, kafka, lambda: c.begin_checkpoint(NAME, 1, gen, ACTOR), e.SINK_HALTED_LOST_DATA)
    assert "NOT verified" in halted.message and "read_committed consumer first" in halted.message
    assert "re-deliver its data if needed" not in halted.message


def test_invariant_checker_catches_silent_loss(coordinator: Coordinator, kafka: RecordingControlPlane) -> None:
    c = coordinator
    gen = start(c)
    attempt, winners = write_batch(c, gen, 0, 1)
    kafka.fail_next(FENCED)
    with pytest.raises(e.Conflict):
        c.commit(NAME, 0, attempt, gen, results(winners), ACTOR)
    snap = c.snapshot()
    assert check_invariants(snap, settled=True) == []

    no_alert = replace(snap, alerts=[])
    assert any(v.invariant == "L1" and "without a data_lost alert" in v.message for v in check_invariants(no_alert))
    not_halted = replace(snap, sinks=[replace(s, halted_at=None, halted_reason=None) for s in snap.sinks])
    assert any(v.invariant == "L1" and "not halted" in v.message for v in check_invariants(not_halted))
    committed = replace(snap, checkpoints=[replace(cp, state=CheckpointState.COMMITTED) for cp in snap.checkpoints])
    assert any(v.invariant == "I2" and "were lost" in v.message for v in check_invariants(committed))


# --- over HTTP -------------------------------------------------------------------------------


@pytest.fixture
def admin(coordinator: Coordinator) -> Iterator[ProtocolClient]:
    with TestClient(create_app(coordinator, admin_token=ADMIN, token_secret=SECRET)) as client:
        yield ProtocolClient(client, ADMIN)


def metric_text(client: ProtocolClient, name: str, sink: str = NAME) -> float:
    resp = client.request("GET", "/metrics", expect=None)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    prefix = f'{name}{{sink="{sink}"}} '
    lines = [line for line in resp.text.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix):]) if lines else 0.0


def test_halt_and_acknowledge_over_http(admin: ProtocolClient, kafka: RecordingControlPlane) -> None:
    writer = admin.with_token(admin.register_sink(NAME, PREFIX, expect=201)["writer_token"])
    assert writer.request("GET", f"/v1/sinks/{NAME}")["halted"] is False
    gen = writer.start_generation(NAME, "query-1", "run-1")["generation"]
    attempt = writer.begin(NAME, 0, gen, partitions=1)["attempt"]
    lease = writer.lease(NAME, 0, attempt, gen, 0, 11)
    before = metric_text(admin, "coordinator_checkpoints_lost_total")

    kafka.fail_next(ControlPlaneError("transaction timed out", retriable=False, code="producer_fenced"))
    resp = writer.commit(NAME, 0, attempt, gen, {0: Winner.of(lease, 777, producer_epoch=2)}, expect=409)
    assert resp["error"]["reason"] == "data_lost" and resp["error"]["detail"]["batch_id"] == 0

    assert metric_text(admin, "coordinator_checkpoints_lost_total") == before + 1
    sink = writer.request("GET", f"/v1/sinks/{NAME}")
    assert sink["halted"] is True and "producer_fenced" in sink["halted_reason"] and sink["halted_at"]
    cp = writer.checkpoint(NAME, 0)
    assert cp["checkpoint"]["state"] == "LOST" and "producer_fenced" in cp["checkpoint"]["lost_reason"]
    assert {x["state"] for x in cp["leases"]} == {"LOST"}

    halted = writer.begin(NAME, 1, gen, expect=409)["error"]
    assert halted["reason"] == "sink_halted_lost_data"
    assert "acknowledge" in halted["message"] and halted["detail"]["acknowledge"] == f"/v1/sinks/{NAME}/lost-data/acknowledge"

    path = f"/v1/sinks/{NAME}/lost-data/acknowledge"
    assert writer.request("POST", path, {"reason": "mine"}, expect=403)["error"]["reason"] == "forbidden"
    assert admin.request("POST", path, {}, expect=422)["error"]["detail"]["fields"][0]["field"] == "reason"
    ack = admin.request("POST", path, {"reason": "re-sent from the source", "operator": "bob@ops"})
    assert ack["acknowledged"] is True and ack["lost_batches"] == [0] and ack["sink"]["halted"] is False
    again = admin.request("POST", path, {"reason": "re-sent from the source", "operator": "bob@ops"})
    assert again["acknowledged"] is False and again["sink"]["halted"] is False

    trail = writer.request("GET", f"/v1/sinks/{NAME}/events", params={"limit": 1000})
    kinds = [ev["kind"] for ev in trail]
    assert kinds.count("data_lost") == 1 and kinds.count("lost_data_acknowledged") == 1
    assert kinds.index("data_lost") < kinds.index("lost_data_acknowledged")
    (ack_event,) = [ev for ev in trail if ev["kind"] == "lost_data_acknowledged"]
    assert ack_event["actor"] == "admin" and ack_event["detail"]["operator"] == "bob@ops" and ack_event["at"]

    assert writer.begin(NAME, 0, gen)["action"] == "skip"
    assert writer.begin(NAME, 1, gen)["action"] == "write"
    assert metric_text(admin, "coordinator_lost_data_acknowledged_total") >= 1
