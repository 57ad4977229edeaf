"""The coordinator's operations through `Coordinator` on a real Postgres (a fresh migrated database
per test, see conftest.py), with the record-only Kafka control plane and a manual clock.

Every scenario ends with the invariant checker over the whole durable state; every refused call
is checked to leave that state, the audit trail and Kafka untouched (I5)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from coordinator.service.clock import ManualClock
from coordinator import on_loop
from coordinator.kafka.control_plane import (
    NOT_TRIED,
    CallOutcome,
    ControlPlaneError,
    KafkaTarget,
    PreparedTransaction,
    RecordingControlPlane,
)
from coordinator.protocol import errors as e
from coordinator.protocol import recovery_rules
from coordinator.protocol.invariants import check_committed_unchanged, check_invariants, check_unchanged
from coordinator.protocol.model import Lease, PartitionResult as PR
from coordinator.protocol.rules import BeginAction, PrecommitRequest
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState, TransactionalIdState
from coordinator.http.schemas import BeginOut, CommitOut
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.store.tables import attempts, checkpoints, events, generations, leases, sinks, transactional_ids

NAME = "orders"
PREFIX = "orders-eos"
TIMEOUT_MS = 60_000
MARGIN_MS = 6_000  # the default for a 60 s timeout
ACTOR = "test"


# --- helpers ---------------------------------------------------------------------------------


QUARANTINE_MS = Limits().transactional_id_quarantine_ms + 1


def spec(name: str = NAME, prefix: str = PREFIX, **kw: Any) -> SinkSpec:
    return SinkSpec(name=name, transactional_id_prefix=prefix, bootstrap_servers="kafka:9092", topics=["out"], **kw)


def start(c: Coordinator, *, query: str = "q1", run: str = "r1", name: str = NAME, **kw: Any) -> int:
    c.register_sink(spec(name=name, **kw), ACTOR)
    gen, _ = c.start_generation(name, query, run, ACTOR)
    return gen


def req(lease: Lease, *, epoch: int = 0, records: int = 10) -> PrecommitRequest:
    return PrecommitRequest(producer_id=1000 + lease.id, producer_epoch=epoch, records=records, bytes=records * 100)


def lease_and_precommit(c: Coordinator, batch: int, attempt: int, gen: int, partition: int, task: int,
                        name: str = NAME) -> Lease:
    x = c.begin_partition(name, batch, attempt, gen, partition, task)
    return c.precommit(name, x.id, gen, req(x))


def counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
            for t in (sinks, generations, checkpoints, attempts, leases, transactional_ids, events)
        }


def kafka_calls(kafka: RecordingControlPlane) -> tuple[int, int]:
    return len(kafka.commits), len(kafka.aborts)


def assert_invariants(c: Coordinator, *, settled: bool = False) -> None:
    violations = check_invariants(c.snapshot(), settled=settled)
    assert violations == [], [str(v) for v in violations]


def refused(
    c: Coordinator,
    kafka: RecordingControlPlane,
    call: Callable[[], Any],
    reason: str,
    error: type[e.ProtocolError] = e.Conflict,
) -> e.ProtocolError:
    """The call is refused with `reason` and changes nothing: durable state, events, Kafka."""
    before, rows, calls = c.snapshot(), counts(c.engine), kafka_calls(kafka)
    with pytest.raises(error) as exc:
        call()
    assert type(exc.value) is error, exc.value
    assert exc.value.reason == reason, exc.value.to_dict()
    after = c.snapshot()
    assert check_unchanged(before, after) == []
    assert counts(c.engine) == rows
    assert kafka_calls(kafka) == calls
    return exc.value


def ids_of(xs: list[Lease]) -> list[str]:
    return sorted(x.transactional_id for x in xs)


def pool(c: Coordinator) -> dict[str, TransactionalIdState]:
    return {t.transactional_id: t.state for t in c.snapshot().transactional_ids}


def lease_state(c: Coordinator, lease_id: int) -> LeaseState:
    return next(x.state for x in c.snapshot().leases if x.id == lease_id)


def event_kinds(c: Coordinator, name: str = NAME) -> list[str]:
    return [ev["kind"] for ev in c.list_events(name, limit=1000)]


def committed_events(c: Coordinator, batch_id: int) -> list[tuple[str, dict[str, Any]]]:
    """(actor, detail) of the batch's checkpoint_committed events (written only when a decided
    commit is finished after its commit call)."""
    return [(ev["actor"], ev["detail"]) for ev in c.list_events(NAME, batch_id=batch_id, limit=1000)
            if ev["kind"] == "checkpoint_committed"]


@pytest.fixture
def offline(engine: Engine, clock: ManualClock) -> Iterator[Coordinator]:
    """The same database served by a coordinator with no Kafka control plane configured."""
    c = Coordinator(engine, None, clock=clock)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _invariants_hold_at_the_end(coordinator: Coordinator) -> Iterator[None]:
    yield
    assert_invariants(coordinator)


# --- the happy path --------------------------------------------------------------------------


def test_happy_path_every_transition(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    sink, created = c.register_sink(spec(), ACTOR)
    assert created and sink.name == NAME and sink.generation == 0 and sink.lineage_query_id is None
    assert sink.commit_margin_ms == MARGIN_MS and sink.transaction_timeout_ms == TIMEOUT_MS

    gen, aborts = c.start_generation(NAME, "q1", "r1", ACTOR)
    assert gen == 1 and aborts.aborted == [] and aborts.pending == []
    assert c.get_sink(NAME).lineage_query_id == "q1"

    begun = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.must_write
    assert begun.checkpoint.state is CheckpointState.OPEN and begun.checkpoint.current_attempt == 1
    assert begun.attempt is not None and begun.attempt.number == 1 and begun.attempt.state is AttemptState.OPEN
    assert begun.older_aborted == [] and begun.older_abort_pending == []

    clock.advance(ms=100)
    p0 = c.begin_partition(NAME, 0, 1, gen, 0, 10)
    p1 = c.begin_partition(NAME, 0, 1, gen, 1, 11)
    p1_spec = c.begin_partition(NAME, 0, 1, gen, 1, 12)  # a speculative copy of partition 1
    for x, ordinal in ((p0, 0), (p1, 1), (p1_spec, 2)):
        assert x.state is LeaseState.LEASED
        assert x.transactional_id == f"{PREFIX}-{ordinal}"
        assert x.leased_at == clock.now()
        assert (x.deadline_at - x.leased_at).total_seconds() * 1000 == TIMEOUT_MS
    assert len({p0.id, p1.id, p1_spec.id}) == 3
    snap = c.snapshot()
    assert {t.transactional_id: (t.state, t.lease_id) for t in snap.transactional_ids} == {
        f"{PREFIX}-0": (TransactionalIdState.LEASED, p0.id),
        f"{PREFIX}-1": (TransactionalIdState.LEASED, p1.id),
        f"{PREFIX}-2": (TransactionalIdState.LEASED, p1_spec.id),
    }
    assert ids_of(c.possibly_open_transactions(NAME)) == ids_of([p0, p1, p1_spec])
    assert_invariants(c)

    clock.advance(ms=1000)
    stored = {}
    for x in (p0, p1, p1_spec):
        done = c.precommit(NAME, x.id, gen, req(x, epoch=3))
        assert done.state is LeaseState.PRECOMMITTED and done.precommitted_at == clock.now()
        assert (done.producer_id, done.producer_epoch, done.records, done.bytes) == (1000 + x.id, 3, 10, 1000)
        stored[x.id] = done
    assert_invariants(c)

    clock.advance(ms=1000)
    result = c.commit(NAME, 0, 1, gen, [PR(0, p0.id), PR(1, p1.id), PR(2, None)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED and result.checkpoint.committed_attempt == 1
    assert result.checkpoint.decided_at == clock.now() and result.checkpoint.committed_at == clock.now()
    assert result.attempt.state is AttemptState.COMMITTED and result.attempt.partitions == 3
    assert sorted((w.partition, w.id) for w in result.winners) == [(0, p0.id), (1, p1.id)]
    assert all(w.state is LeaseState.COMMITTED for w in result.winners)
    # winners committed by resume with the stored producer id and epoch
    assert sorted(kafka.commits, key=lambda t: t[1].transactional_id) == [
        (NAME, PreparedTransaction(p0.transactional_id, 1000 + p0.id, 3)),
        (NAME, PreparedTransaction(p1.transactional_id, 1000 + p1.id, 3)),
    ]
    # the speculative loser aborted, and its id free again
    assert kafka.aborts == [(NAME, p1_spec.transactional_id)]
    assert result.aborts.aborted == [p1_spec.transactional_id] and result.aborts.pending == []
    assert lease_state(c, p1_spec.id) is LeaseState.ABORTED
    assert set(pool(c).values()) == {TransactionalIdState.FREE}
    assert c.possibly_open_transactions(NAME) == []
    # one event per batch: its decision (the attempt and checkpoint rows record begin and commit)
    kinds = event_kinds(c)
    for kind in ("sink_registered", "generation_started", "commit_decided", "transactions_aborted"):
        assert kind in kinds
    assert [ev["kind"] for ev in c.list_events(NAME, batch_id=0, limit=1000)] == ["commit_decided"]
    (decided,) = [ev for ev in c.list_events(NAME, limit=1000) if ev["kind"] == "commit_decided"]
    assert decided["actor"] == ACTOR and decided["detail"]["winners"] == {"partitions": [0, 1], "lease_ids": [p0.id, p1.id]}
    assert_invariants(c, settled=True)

    # Spark replays batch 0 (crash after the commit, before its commit log): skip
    committed = c.snapshot()
    rows, calls = counts(c.engine), kafka_calls(kafka)
    replay = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    assert replay.action is BeginAction.SKIP and not replay.must_write
    assert replay.checkpoint == result.checkpoint and replay.attempt == result.attempt
    assert counts(c.engine) == rows and kafka_calls(kafka) == calls
    # ... also from a restarted driver (a new generation)
    gen2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    replay2 = c.begin_checkpoint(NAME, 0, gen2, ACTOR)
    assert replay2.action is BeginAction.SKIP and replay2.checkpoint.state is CheckpointState.COMMITTED
    assert check_committed_unchanged(committed, c.snapshot()) == []

    # the next batch reuses the pool
    assert c.begin_checkpoint(NAME, 1, gen2, ACTOR).attempt.number == 1
    nxt = c.begin_partition(NAME, 1, 1, gen2, 0, 20)
    assert nxt.transactional_id == f"{PREFIX}-0"
    nxt = c.precommit(NAME, nxt.id, gen2, req(nxt))
    c.commit(NAME, 1, 1, gen2, [PR(0, nxt.id)], ACTOR)
    assert check_committed_unchanged(committed, c.snapshot()) == []
    assert [cp.batch_id for cp in c.list_checkpoints(NAME, state=CheckpointState.COMMITTED)] == [1, 0]
    assert_invariants(c, settled=True)


# --- a commit left COMMITTING by Kafka -------------------------------------------------------


def _decided_but_unfinished(c: Coordinator, kafka: RecordingControlPlane) -> tuple[int, Lease, Lease]:
    """Batch 0's commit is decided, but Kafka is unreachable: neither the winner's commit nor the
    loser's abort gets through."""
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    winner = lease_and_precommit(c, 0, 1, gen, 0, 1)
    loser = lease_and_precommit(c, 0, 1, gen, 0, 2)
    kafka.fail_next(ControlPlaneError("broker unreachable", retriable=True), times=2)
    with pytest.raises(e.Unavailable) as exc:
        c.commit(NAME, 0, 1, gen, [PR(0, winner.id)], ACTOR)
    assert exc.value.reason == "kafka_commit_failed"
    assert winner.transactional_id in exc.value.detail["failures"]
    assert kafka.commits == [] and kafka.aborts == []
    return gen, winner, loser


def test_kafka_failure_leaves_committing_and_a_new_generation_resumes(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    gen, winner, loser = _decided_but_unfinished(c, kafka)
    d = c.checkpoint_detail(NAME, 0)
    assert d.checkpoint.state is CheckpointState.COMMITTING and d.checkpoint.committed_attempt == 1
    assert d.attempts[0].state is AttemptState.COMMITTING
    assert lease_state(c, winner.id) is LeaseState.COMMITTING
    assert lease_state(c, loser.id) is LeaseState.ABORTING
    assert kafka.commits == []
    assert pool(c) == {winner.transactional_id: TransactionalIdState.LEASED,
                       loser.transactional_id: TransactionalIdState.LEASED}
    assert "commit_failed" in event_kinds(c) and "abort_failed" in event_kinds(c)
    assert_invariants(c)

    # the decision stands across a driver restart: the new generation does not abort it
    gen2, aborts = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert gen2 == gen + 1
    assert winner.transactional_id not in aborts.aborted + aborts.pending
    assert lease_state(c, winner.id) is LeaseState.COMMITTING
    # the old driver is fenced, even for its decided batch
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [PR(0, winner.id)], ACTOR), e.STALE_GENERATION)

    begun = c.begin_checkpoint(NAME, 0, gen2, ACTOR)
    assert begun.action is BeginAction.RESUME and not begun.must_write
    assert begun.checkpoint.state is CheckpointState.COMMITTED
    assert begun.attempt is not None and begun.attempt.number == 1 and begun.attempt.state is AttemptState.COMMITTED
    assert kafka.commits == [(NAME, PreparedTransaction(winner.transactional_id, 1000 + winner.id, 0))]
    # finishing the decided commit also ends the loser's transaction, which would otherwise block
    # read_committed consumers of its partitions
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    assert c.possibly_open_transactions(NAME) == []
    # finished after its commit call: an event says who finished it (the decision's call wrote none)
    assert committed_events(c, 0) == [("recovery", {"batch_id": 0, "attempt": 1, "by": "begin"})]
    assert_invariants(c, settled=True)

    # resume answers from the record, with no second effect
    calls = kafka_calls(kafka)
    resumed = c.resume(NAME, 0)
    assert resumed.checkpoint == begun.checkpoint and resumed.attempt == begun.attempt
    assert [w.id for w in resumed.winners] == [winner.id] and resumed.winners[0].state is LeaseState.COMMITTED
    assert kafka_calls(kafka) == calls
    assert c.begin_checkpoint(NAME, 0, gen2, ACTOR).action is BeginAction.SKIP
    assert len(committed_events(c, 0)) == 1
    assert_invariants(c, settled=True)


def test_kafka_failure_then_the_same_driver_retries_commit(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen, winner, loser = _decided_but_unfinished(c, kafka)
    # a retry naming other winners is refused; the decision stands
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [PR(0, loser.id)], ACTOR), e.WINNER_MISMATCH)
    # Kafka still down: still COMMITTING
    kafka.fail_next(ControlPlaneError("still down", retriable=True))
    with pytest.raises(e.Unavailable) as exc:
        c.commit(NAME, 0, 1, gen, [PR(0, winner.id)], ACTOR)
    assert exc.value.reason == "kafka_commit_failed"
    assert c.checkpoint_detail(NAME, 0).checkpoint.state is CheckpointState.COMMITTING
    result = c.commit(NAME, 0, 1, gen, [PR(0, winner.id)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert committed_events(c, 0) == [("recovery", {"batch_id": 0, "attempt": 1, "by": "commit_retry"})]
    assert kafka.commits == [(NAME, PreparedTransaction(winner.transactional_id, 1000 + winner.id, 0))]
    # the retries also ended the loser's transaction, once
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    assert result.aborts.aborted == [loser.transactional_id] and result.aborts.pending == []
    calls = kafka_calls(kafka)
    assert CommitOut.of(c.commit(NAME, 0, 1, gen, [PR(0, winner.id)], ACTOR)) == CommitOut.of(result)
    assert kafka_calls(kafka) == calls
    assert_invariants(c, settled=True)


def test_losers_are_aborted_even_while_the_winners_commit_waits(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    winner = lease_and_precommit(c, 0, 1, gen, 0, 1)
    loser = lease_and_precommit(c, 0, 1, gen, 0, 2)
    kafka.fail_next(ControlPlaneError("coordinator moving", retriable=True))  # only the winner's commit
    with pytest.raises(e.Unavailable):
        c.commit(NAME, 0, 1, gen, [PR(0, winner.id)], ACTOR)
    assert lease_state(c, winner.id) is LeaseState.COMMITTING
    assert lease_state(c, loser.id) is LeaseState.ABORTED
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    assert c.resume(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
    assert committed_events(c, 0) == [("recovery", {"batch_id": 0, "attempt": 1, "by": "resume"})]
    assert_invariants(c, settled=True)


def test_resume_via_resume_call_and_by_a_later_batch(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen, winner, loser = _decided_but_unfinished(c, kafka)
    # the driver moves on: beginning batch 1 finishes batch 0's decided commit first
    begun = c.begin_checkpoint(NAME, 1, gen, ACTOR)
    assert begun.action is BeginAction.NEW_ATTEMPT
    assert c.checkpoint_detail(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
    assert [t.transactional_id for _, t in kafka.commits] == [winner.transactional_id]
    assert kafka.aborts == [(NAME, loser.transactional_id)]
    # resume of a finished commit answers from the record, with the loser aborted
    resumed = c.resume(NAME, 0)
    assert resumed.checkpoint.state is CheckpointState.COMMITTED
    assert lease_state(c, loser.id) is LeaseState.ABORTED
    assert [t.transactional_id for _, t in kafka.commits] == [winner.transactional_id]
    refused(c, kafka, lambda: c.resume(NAME, 1), e.NOT_COMMITTING)
    assert_invariants(c, settled=True)


# --- fencing (I5) ----------------------------------------------------------------------------


def test_fencing_stale_generation_and_superseded_attempt(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR)
    old_pre = lease_and_precommit(c, 0, 1, g1, 0, 1)
    old_leased = c.begin_partition(NAME, 0, 1, g1, 1, 2)

    g2, fenced = c.start_generation(NAME, "q1", "r2", ACTOR)  # the driver restarted
    assert sorted(fenced.aborted) == ids_of([old_pre, old_leased])
    begun = c.begin_checkpoint(NAME, 0, g2, ACTOR)
    assert begun.attempt.number == 2
    new = c.begin_partition(NAME, 0, 2, g2, 0, 3)
    new_pre = lease_and_precommit(c, 0, 2, g2, 1, 4)
    before = c.snapshot()

    # the zombie driver and its executors (generation 1)
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, g1, ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 1, g1, ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, g1, 2, 9), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 2, g1, 2, 9), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.precommit(NAME, old_leased.id, g1, req(old_leased)), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.precommit(NAME, new.id, g1, req(new)), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, g1, [PR(0, old_pre.id)], ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g1, [PR(0, None), PR(1, new_pre.id)], ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.abort_attempt(NAME, 0, 2, g1, "zombie", ACTOR), e.STALE_GENERATION)
    # a generation nobody started
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, g2 + 1, ACTOR), e.UNKNOWN_GENERATION)
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 2, g2 + 1, 0, 9), e.UNKNOWN_GENERATION)

    # the current generation naming the superseded attempt
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, g2, 2, 9), e.STALE_ATTEMPT)
    refused(c, kafka, lambda: c.precommit(NAME, old_leased.id, g2, req(old_leased)), e.STALE_ATTEMPT)
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, g2, [PR(0, old_pre.id)], ACTOR), e.STALE_ATTEMPT)
    # a retried lease request of the fenced task: its lease is no longer live
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, g2, 0, 1), e.STALE_LEASE)

    # commit of the current attempt naming bad winners
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g2, [PR(0, old_pre.id), PR(1, new_pre.id)], ACTOR), e.STALE_LEASE)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g2, [PR(0, new_pre.id), PR(1, None)], ACTOR), e.LEASE_MISMATCH)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g2, [PR(0, new.id), PR(1, new_pre.id)], ACTOR),
            e.WINNER_NOT_PRECOMMITTED)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g2, [PR(1, new_pre.id)], ACTOR), "partitions_incomplete", e.Invalid)
    refused(c, kafka, lambda: c.commit(NAME, 0, 3, g2, [PR(0, None)], ACTOR), "unknown_attempt", e.NotFound)
    # a pre-commit contradicting the stored one
    other = PrecommitRequest(producer_id=1000 + new_pre.id, producer_epoch=1, records=10, bytes=1000)
    refused(c, kafka, lambda: c.precommit(NAME, new_pre.id, g2, other), e.PRECOMMIT_MISMATCH)
    refused(c, kafka, lambda: c.precommit(NAME, 999_999, g2, req(new)), "unknown_lease", e.NotFound)
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 2, g2, 256, 9), "partition_out_of_range", e.Invalid)

    assert check_unchanged(before, c.snapshot()) == []
    assert_invariants(c)
    # and the current attempt still commits
    new = c.precommit(NAME, new.id, g2, req(new))
    result = c.commit(NAME, 0, 2, g2, [PR(0, new.id), PR(1, new_pre.id)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert {t.transactional_id for _, t in kafka.commits} == {new.transactional_id, new_pre.transactional_id}
    # decided: nothing more to do for any attempt of batch 0
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, g2, [PR(0, old_pre.id)], ACTOR), e.COMMIT_DECIDED)
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 2, g2, 0, 77), e.COMMIT_DECIDED)
    refused(c, kafka, lambda: c.abort_attempt(NAME, 0, 2, g2, "late", ACTOR), e.COMMIT_DECIDED)
    refused(c, kafka, lambda: c.commit(NAME, 0, 2, g2, [PR(0, new.id), PR(1, None)], ACTOR), e.WINNER_MISMATCH)
    assert_invariants(c, settled=True)


def test_fencing_aborted_and_superseded_attempt_in_one_generation(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    leased = c.begin_partition(NAME, 0, 1, gen, 0, 1)
    pre = lease_and_precommit(c, 0, 1, gen, 1, 2)
    attempt, outcome = c.abort_attempt(NAME, 0, 1, gen, "driver_gave_up", ACTOR)
    assert attempt.state is AttemptState.ABORTED and attempt.abort_reason == "driver_gave_up"
    assert sorted(outcome.aborted) == ids_of([leased, pre]) and outcome.pending == []
    assert sorted(t for _, t in kafka.aborts) == ids_of([leased, pre])

    # the aborted attempt is still the current one: ATTEMPT_ABORTED
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, gen, 2, 3), e.ATTEMPT_ABORTED)
    refused(c, kafka, lambda: c.precommit(NAME, leased.id, gen, req(leased)), e.ATTEMPT_ABORTED)
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [PR(0, None), PR(1, pre.id)], ACTOR), e.ATTEMPT_ABORTED)
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, gen, 0, 1), e.STALE_LEASE)

    # the driver begins the batch again in the same generation: a new attempt supersedes it
    again = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    assert again.action is BeginAction.NEW_ATTEMPT and again.attempt.number == 2
    assert sorted(again.older_aborted) == ids_of([leased, pre])
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, gen, 2, 3), e.STALE_ATTEMPT)
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [PR(0, None), PR(1, pre.id)], ACTOR), e.STALE_ATTEMPT)
    assert_invariants(c, settled=True)


def test_begin_of_another_batch_supersedes_the_open_attempt(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    x = lease_and_precommit(c, 0, 1, gen, 0, 1)
    c.begin_checkpoint(NAME, 1, gen, ACTOR)  # one micro-batch in flight per query
    assert lease_state(c, x.id) is LeaseState.ABORTED
    assert kafka.aborts == [(NAME, x.transactional_id)]
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [PR(0, x.id)], ACTOR), e.ATTEMPT_ABORTED)


# --- retries: same answer, no second effect --------------------------------------------------


def test_retries_answer_the_same_and_have_no_second_effect(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    sink, created = c.register_sink(spec(), ACTOR)
    rows = counts(c.engine)
    assert c.register_sink(spec(), ACTOR) == (sink, False)
    assert counts(c.engine) == rows
    refused(c, kafka, lambda: c.register_sink(spec(transaction_timeout_ms=30_000), ACTOR), e.SINK_EXISTS)

    gen, _ = c.start_generation(NAME, "q1", "r1", ACTOR)
    rows = counts(c.engine)
    clock.advance(ms=5)
    assert c.start_generation(NAME, "q1", "r1", ACTOR)[0] == gen
    assert counts(c.engine) == rows and c.get_sink(NAME).generation == gen

    b1 = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    rows = counts(c.engine)
    b2 = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    assert b2.action is BeginAction.CONTINUE
    assert BeginOut.of(b1) == BeginOut.of(b2) and b1.attempt == b2.attempt and b1.checkpoint == b2.checkpoint
    assert counts(c.engine) == rows

    x1 = c.begin_partition(NAME, 0, 1, gen, 0, 7)
    y = c.begin_partition(NAME, 0, 1, gen, 1, 8)
    rows = counts(c.engine)
    clock.advance(ms=5)
    assert c.begin_partition(NAME, 0, 1, gen, 0, 7) == x1
    assert counts(c.engine) == rows

    p1 = c.precommit(NAME, x1.id, gen, req(x1))
    rows = counts(c.engine)
    clock.advance(ms=5)
    assert c.precommit(NAME, x1.id, gen, req(x1)) == p1
    assert counts(c.engine) == rows
    # a retried lease request after the pre-commit still finds the same lease
    assert c.begin_partition(NAME, 0, 1, gen, 0, 7) == p1

    first = c.commit(NAME, 0, 1, gen, [PR(0, p1.id), PR(1, None)], ACTOR)  # y loses: partition 1 empty
    assert first.aborts.aborted == [y.transactional_id]
    rows, calls = counts(c.engine), kafka_calls(kafka)
    clock.advance(ms=5)
    second = c.commit(NAME, 0, 1, gen, [PR(1, None), PR(0, p1.id)], ACTOR)
    assert (second.checkpoint, second.attempt, second.winners) == (first.checkpoint, first.attempt, first.winners)
    assert CommitOut.of(second) == CommitOut.of(first)
    assert counts(c.engine) == rows and kafka_calls(kafka) == calls
    # the pre-commit retried after the commit answers from the record too
    assert c.precommit(NAME, x1.id, gen, req(x1)).state is LeaseState.COMMITTED
    assert counts(c.engine) == rows

    # abort twice
    c.begin_checkpoint(NAME, 1, gen, ACTOR)
    z = lease_and_precommit(c, 1, 1, gen, 0, 9)
    a1 = c.abort_attempt(NAME, 1, 1, gen, "give_up", ACTOR)
    rows, calls = counts(c.engine), kafka_calls(kafka)
    clock.advance(ms=5)
    a2 = c.abort_attempt(NAME, 1, 1, gen, "give_up", ACTOR)
    assert a1 == a2 and a1[1].aborted == [z.transactional_id]
    assert counts(c.engine) == rows and kafka_calls(kafka) == calls
    assert_invariants(c, settled=True)


def test_start_generation_retry_after_a_newer_generation_is_fenced(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    g1 = start(c)
    g2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert g2 == g1 + 1
    refused(c, kafka, lambda: c.start_generation(NAME, "q1", "r1", ACTOR), e.STALE_GENERATION)
    assert c.start_generation(NAME, "q1", "r2", ACTOR)[0] == g2


def test_start_generation_retry_answers_the_same_aborts(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR)
    held = [lease_and_precommit(c, 0, 1, g1, p, 10 + p) for p in range(3)]
    first = c.start_generation(NAME, "q1", "r2", ACTOR)
    calls = kafka_calls(kafka)
    again = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert first == again
    assert sorted(first[1].aborted) == sorted(x.transactional_id for x in held) and first[1].pending == []
    assert kafka_calls(kafka) == calls  # the retry aborted nothing a second time


# --- the timeout gate (I4) -------------------------------------------------------------------


def _leased_and_precommitted(c: Coordinator, clock: ManualClock) -> tuple[int, Lease, Lease]:
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    a = c.begin_partition(NAME, 0, 1, gen, 0, 1)
    b = c.begin_partition(NAME, 0, 1, gen, 1, 2)
    clock.advance(ms=1000)
    a = c.precommit(NAME, a.id, gen, req(a))
    b = c.precommit(NAME, b.id, gen, req(b))
    return gen, a, b


def test_commit_refused_within_the_margin_aborts_the_attempt(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen, a, b = _leased_and_precommitted(c, clock)
    # 1 ms inside the margin of the deadline
    clock.advance(ms=(a.deadline_at - clock.now()).total_seconds() * 1000 - MARGIN_MS + 1)
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, 1, gen, [PR(0, a.id), PR(1, b.id)], ACTOR)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE
    assert sorted(exc.value.detail["lease_ids"]) == sorted([a.id, b.id])
    d = c.checkpoint_detail(NAME, 0)
    assert d.checkpoint.state is CheckpointState.OPEN and d.checkpoint.committed_attempt is None
    assert d.attempts[0].state is AttemptState.ABORTED and d.attempts[0].abort_reason == e.DEADLINE_TOO_CLOSE
    assert {x.state for x in d.leases} == {LeaseState.ABORTED}
    assert kafka.commits == []
    assert sorted(t for _, t in kafka.aborts) == ids_of([a, b])
    assert set(pool(c).values()) == {TransactionalIdState.FREE}
    assert "commit_refused" in event_kinds(c)
    assert_invariants(c, settled=True)

    # the retry gets the same answer and changes nothing
    err = refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [PR(0, a.id), PR(1, b.id)], ACTOR), e.DEADLINE_TOO_CLOSE)
    assert err.status == 409
    # Spark replays the batch under a new attempt
    again = c.begin_checkpoint(NAME, 0, gen, ACTOR)
    assert again.action is BeginAction.NEW_ATTEMPT and again.attempt.number == 2
    assert sorted(again.older_aborted) == ids_of([a, b])


def test_commit_exactly_at_the_margin_is_decided(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen, a, b = _leased_and_precommitted(c, clock)
    clock.advance(ms=(a.deadline_at - clock.now()).total_seconds() * 1000 - MARGIN_MS)
    assert (a.deadline_at - clock.now()).total_seconds() * 1000 == MARGIN_MS
    result = c.commit(NAME, 0, 1, gen, [PR(0, a.id), PR(1, b.id)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert result.attempt.decided_at == clock.now()
    assert len(kafka.commits) == 2 and kafka.aborts == []
    assert_invariants(c, settled=True)


def test_precommit_near_the_deadline_is_refused(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    late = c.begin_partition(NAME, 0, 1, gen, 0, 1)
    clock.advance(ms=1)
    edge = c.begin_partition(NAME, 0, 1, gen, 1, 2)  # leased 1 ms later
    clock.advance(ms=TIMEOUT_MS - MARGIN_MS)  # late: 1 ms inside the margin; edge: exactly at it
    err = refused(c, kafka, lambda: c.precommit(NAME, late.id, gen, req(late)), e.DEADLINE_TOO_CLOSE)
    assert err.detail["margin_ms"] == MARGIN_MS
    assert c.precommit(NAME, edge.id, gen, req(edge)).state is LeaseState.PRECOMMITTED
    assert lease_state(c, late.id) is LeaseState.LEASED


def test_expired_lease_cannot_be_committed(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen, a, b = _leased_and_precommitted(c, clock)
    clock.advance(seconds=3600)
    with pytest.raises(e.Conflict) as exc:
        c.commit(NAME, 0, 1, gen, [PR(0, a.id), PR(1, None)], ACTOR)
    assert exc.value.reason == e.DEADLINE_TOO_CLOSE
    assert kafka.commits == []
    assert sorted(t for _, t in kafka.aborts) == ids_of([a, b])


# --- scale-down ------------------------------------------------------------------------------


def test_scale_down_between_attempts_with_aborts_pending(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    g1 = start(offline)
    offline.begin_checkpoint(NAME, 0, g1, ACTOR)
    first = [lease_and_precommit(offline, 0, 1, g1, p, p) for p in range(6)]
    first += [offline.begin_partition(NAME, 0, 1, g1, p, p) for p in (6, 7)]  # never flushed
    eight = ids_of(first)
    assert eight == sorted(f"{PREFIX}-{i}" for i in range(8))

    g2, fenced = offline.start_generation(NAME, "q1", "r2", ACTOR)
    assert fenced.aborted == [] and sorted(fenced.pending) == eight  # no control plane: pending
    begun = offline.begin_checkpoint(NAME, 0, g2, ACTOR)
    assert begun.attempt.number == 2
    assert begun.older_aborted == [] and sorted(begun.older_abort_pending) == eight
    assert {x.state for x in offline.snapshot().leases} == {LeaseState.ABORTING}

    second = [offline.begin_partition(NAME, 0, 2, g2, p, 100 + p) for p in range(3)]
    # none of the ids that may hold an attempt-1 transaction is handed out again (I3)
    assert not set(ids_of(second)) & set(eight)
    assert ids_of(second) == sorted(f"{PREFIX}-{i}" for i in (8, 9, 10))
    open_now = offline.possibly_open_transactions(NAME)
    assert ids_of(open_now) == sorted(eight + ids_of(second))
    assert {x.state for x in open_now if x.transactional_id in eight} == {LeaseState.ABORTING}
    assert offline.run_pending_aborts(NAME).pending == eight
    assert kafka.aborts == []
    assert_invariants(offline)

    # a coordinator with a control plane runs the pending aborts; only then are the ids free
    outcome = coordinator.run_pending_aborts(NAME)
    assert sorted(outcome.aborted) == eight and outcome.pending == []
    assert sorted(t for _, t in kafka.aborts) == eight
    assert ids_of(coordinator.possibly_open_transactions(NAME)) == ids_of(second)
    assert coordinator.run_pending_aborts(NAME).aborted == []  # nothing left: no second abort
    assert len(kafka.aborts) == 8
    reused = coordinator.begin_partition(NAME, 0, 2, g2, 0, 200)  # a speculative copy
    # the aborted ids are free but in quarantine (their tries may still be alive): the pool grows
    assert reused.transactional_id == f"{PREFIX}-11"

    second = [coordinator.precommit(NAME, x.id, g2, req(x)) for x in second]
    result = coordinator.commit(NAME, 0, 2, g2, [PR(p, second[p].id) for p in range(3)], ACTOR)
    assert result.attempt.partitions == 3
    assert sorted(t.transactional_id for _, t in kafka.commits) == ids_of(second)
    assert (NAME, reused.transactional_id) in kafka.aborts[8:]
    assert_invariants(coordinator, settled=True)


def test_scale_down_with_control_plane_aborts_every_possibly_open_id(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR)
    first = [lease_and_precommit(c, 0, 1, g1, p, p) for p in range(5)]
    first += [c.begin_partition(NAME, 0, 1, g1, p, p) for p in (5, 6, 7)]
    g2, fenced = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert sorted(fenced.aborted) == ids_of(first) and fenced.pending == []
    assert sorted(t for _, t in kafka.aborts) == ids_of(first)
    begun = c.begin_checkpoint(NAME, 0, g2, ACTOR)
    assert sorted(begun.older_aborted) == ids_of(first) and begun.older_abort_pending == []
    clock.advance(ms=QUARANTINE_MS)
    second = [lease_and_precommit(c, 0, 2, g2, p, 100 + p) for p in range(3)]
    assert ids_of(second) == [f"{PREFIX}-{i}" for i in range(3)]  # resolved ids are reused after quarantine
    c.commit(NAME, 0, 2, g2, [PR(p, second[p].id) for p in range(3)], ACTOR)
    assert len(kafka.aborts) == 8
    assert_invariants(c, settled=True)


def test_fewer_partitions_in_a_later_batch(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    wide = [lease_and_precommit(c, 0, 1, gen, p, p) for p in range(8)]
    c.commit(NAME, 0, 1, gen, [PR(p, wide[p].id) for p in range(8)], ACTOR)
    c.begin_checkpoint(NAME, 1, gen, ACTOR)
    narrow = [lease_and_precommit(c, 1, 1, gen, p, 10 + p) for p in range(3)]
    assert ids_of(narrow) == [f"{PREFIX}-{i}" for i in range(3)]
    refused(c, kafka, lambda: c.commit(NAME, 1, 1, gen, [PR(p, narrow[p].id) for p in (0, 1)] + [PR(3, None)], ACTOR),
            "partitions_incomplete", e.Invalid)
    result = c.commit(NAME, 1, 1, gen, [PR(p, narrow[p].id) for p in range(3)], ACTOR)
    assert result.attempt.partitions == 3 and len(result.winners) == 3
    assert len(kafka.commits) == 11 and kafka.aborts == []
    assert len(pool(c)) == 8 and set(pool(c).values()) == {TransactionalIdState.FREE}
    assert_invariants(c, settled=True)


# --- lineage ---------------------------------------------------------------------------------


def test_lineage_mismatch_and_reset(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c, query="q1")
    c.begin_checkpoint(NAME, 0, g1, ACTOR)
    x = lease_and_precommit(c, 0, 1, g1, 0, 1)
    c.commit(NAME, 0, 1, g1, [PR(0, x.id)], ACTOR)
    c.begin_checkpoint(NAME, 1, g1, ACTOR)
    open_lease = c.begin_partition(NAME, 1, 1, g1, 0, 2)

    # a query from a fresh checkpoint location (batch ids restart at 0) is refused, not skipped
    err = refused(c, kafka, lambda: c.start_generation(NAME, "q2", "r9", ACTOR), e.LINEAGE_MISMATCH)
    assert err.detail == {"bound_query_id": "q1", "query_id": "q2"}

    committed = c.snapshot()
    sink = c.reset_lineage(NAME, "operator", "new checkpoint location")
    assert sink.lineage_query_id is None and sink.generation == g1 + 1
    assert lease_state(c, open_lease.id) is LeaseState.ABORTED
    assert (NAME, open_lease.transactional_id) in kafka.aborts
    assert "lineage_reset" in event_kinds(c)
    # the old driver is fenced; nobody holds the reset's own generation
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 2, g1, ACTOR), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.begin_checkpoint(NAME, 0, sink.generation, ACTOR), e.LINEAGE_NOT_BOUND)

    g3, _ = c.start_generation(NAME, "q2", "r9", ACTOR)
    assert g3 == sink.generation + 1 and c.get_sink(NAME).lineage_query_id == "q2"
    begun = c.begin_checkpoint(NAME, 0, g3, ACTOR)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.must_write  # not skipped: a new lineage
    assert begun.checkpoint.query_id == "q2" and begun.attempt.number == 1
    y = lease_and_precommit(c, 0, 1, g3, 0, 3)
    c.commit(NAME, 0, 1, g3, [PR(0, y.id)], ACTOR)
    assert check_committed_unchanged(committed, c.snapshot()) == []
    assert [cp.query_id for cp in c.list_checkpoints(NAME)] == ["q2"]
    # the old query now is the stranger
    refused(c, kafka, lambda: c.start_generation(NAME, "q1", "r10", ACTOR), e.LINEAGE_MISMATCH)
    assert_invariants(c, settled=True)


def test_reset_lineage_refused_while_a_commit_is_finishing(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen, winner, loser = _decided_but_unfinished(c, kafka)
    err = refused(c, kafka, lambda: c.reset_lineage(NAME, "operator", "oops"), e.COMMIT_IN_PROGRESS)
    assert err.detail == {"batch_ids": [0]}
    c.resume(NAME, 0)
    sink = c.reset_lineage(NAME, "operator", "now")
    assert sink.lineage_query_id is None
    assert_invariants(c, settled=True)


# --- the transactional id pool ---------------------------------------------------------------


def test_pool_holds_ids_until_their_aborts_succeed(coordinator: Coordinator, kafka: RecordingControlPlane,
                                                  clock: ManualClock):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    one = c.begin_partition(NAME, 0, 1, gen, 0, 1)
    assert one.transactional_id == f"{PREFIX}-0"
    c.abort_attempt(NAME, 0, 1, gen, "retry", ACTOR)
    clock.advance(ms=QUARANTINE_MS)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    three = [c.begin_partition(NAME, 0, 2, gen, p, 10 + p) for p in range(3)]
    assert [x.transactional_id for x in three] == [f"{PREFIX}-{i}" for i in range(3)]
    # Kafka fails every abort: the ids stay held
    kafka.fail_next(ControlPlaneError("down", retriable=True), times=3)
    _, outcome = c.abort_attempt(NAME, 0, 2, gen, "retry", ACTOR)
    assert outcome.aborted == [] and sorted(outcome.pending) == ids_of(three)
    assert "abort_failed" in event_kinds(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    fresh = c.begin_partition(NAME, 0, 3, gen, 0, 20)
    assert fresh.transactional_id == f"{PREFIX}-3"  # the pool grows rather than reuse a held id
    assert sorted(c.run_pending_aborts(NAME).aborted) == ids_of(three)
    clock.advance(ms=QUARANTINE_MS)
    more = [c.begin_partition(NAME, 0, 3, gen, p, 20 + p) for p in (1, 2)]
    assert [x.transactional_id for x in more] == [f"{PREFIX}-0", f"{PREFIX}-1"]
    assert len(pool(c)) == 4
    assert_invariants(c, settled=False)


def test_pool_exhaustion(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen = start(c, max_pool_size=2)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    c.begin_partition(NAME, 0, 1, gen, 0, 1)
    c.begin_partition(NAME, 0, 1, gen, 1, 2)
    err = refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, gen, 2, 3), e.POOL_EXHAUSTED, e.Unavailable)
    assert err.status == 503 and err.detail == {"max_pool_size": 2}
    # a retry of a granted lease still works
    assert c.begin_partition(NAME, 0, 1, gen, 1, 2).transactional_id == f"{PREFIX}-1"
    c.abort_attempt(NAME, 0, 1, gen, "too small", ACTOR)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    # both ids are in quarantine (freed from undecided tries): the pool is exhausted until it ends
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 2, gen, 2, 3), e.POOL_EXHAUSTED, e.Unavailable)
    clock.advance(ms=QUARANTINE_MS)
    assert c.begin_partition(NAME, 0, 2, gen, 2, 3).transactional_id == f"{PREFIX}-0"
    assert len(pool(c)) == 2


# --- speculative and retried task attempts ---------------------------------------------------


def test_speculative_and_retried_tasks_get_distinct_leases(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    tasks = [c.begin_partition(NAME, 0, 1, gen, 0, t) for t in (100, 101, 102)]  # failed, retry, speculative
    assert len({x.id for x in tasks}) == 3 and len(set(ids_of(tasks))) == 3
    assert c.begin_partition(NAME, 0, 1, gen, 0, 101) == tasks[1]  # the retry's own retry
    other = lease_and_precommit(c, 0, 1, gen, 1, 103)
    pre = [c.precommit(NAME, x.id, gen, req(x)) for x in tasks[1:]]  # the failed task never flushed
    result = c.commit(NAME, 0, 1, gen, [PR(0, pre[1].id), PR(1, other.id)], ACTOR)  # the speculative copy won
    assert sorted(w.id for w in result.winners) == sorted([pre[1].id, other.id])
    assert sorted(t.transactional_id for _, t in kafka.commits) == ids_of([pre[1], other])
    assert sorted(t for _, t in kafka.aborts) == ids_of([tasks[0], tasks[1]])
    states = {x.id: x.state for x in c.snapshot().leases}
    assert states[tasks[0].id] is LeaseState.ABORTED and states[tasks[1].id] is LeaseState.ABORTED
    assert states[tasks[2].id] is LeaseState.COMMITTED
    assert set(pool(c).values()) == {TransactionalIdState.FREE}
    assert_invariants(c, settled=True)


# --- empty partitions ------------------------------------------------------------------------


def test_empty_partitions_and_all_empty_batches(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    x = lease_and_precommit(c, 0, 1, gen, 1, 1)
    result = c.commit(NAME, 0, 1, gen, [PR(0, None), PR(1, x.id), PR(2, None)], ACTOR)
    assert result.attempt.partitions == 3 and [w.partition for w in result.winners] == [1]
    assert [t.transactional_id for _, t in kafka.commits] == [x.transactional_id]

    for batch, n in ((1, 4), (2, 0)):  # all partitions empty; no partitions at all
        c.begin_checkpoint(NAME, batch, gen, ACTOR)
        calls = kafka_calls(kafka)
        done = c.commit(NAME, batch, 1, gen, [PR(p, None) for p in range(n)], ACTOR)
        assert done.checkpoint.state is CheckpointState.COMMITTED and done.winners == []
        assert done.attempt.partitions == n and done.attempt.state is AttemptState.COMMITTED
        assert kafka_calls(kafka) == calls
        assert c.begin_checkpoint(NAME, batch, gen, ACTOR).action is BeginAction.SKIP
    assert_invariants(c, settled=True)


# --- sinks -----------------------------------------------------------------------------------


def test_prefix_clash_between_sinks_is_refused(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    c.register_sink(spec("a", "orders-eos"), ACTOR)
    for prefix in ("orders-eos", "orders-eos-eu", "orders", "o"):
        err = refused(c, kafka, lambda: c.register_sink(spec("b", prefix), ACTOR), e.PREFIX_CLASH)
        assert err.detail == {"other_sink": "a"}
    sink, created = c.register_sink(spec("b", "orders-eu"), ACTOR)
    assert created and sink.transactional_id_prefix == "orders-eu"
    assert [s.name for s in c.list_sinks()] == ["a", "b"]


def test_sink_configuration_is_validated(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    refused(c, kafka, lambda: c.register_sink(spec(transaction_timeout_ms=900_001), ACTOR),
            "transaction_timeout_above_broker_max", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(commit_margin_ms=60_000), ACTOR), "commit_margin_too_large", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(commit_margin_ms=-1), ACTOR), "commit_margin_negative", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(prefix="bad prefix"), ACTOR),
            "invalid_transactional_id_prefix", e.Invalid)
    refused(c, kafka, lambda: c.register_sink(spec(name="bad/name"), ACTOR), "invalid_sink_name", e.Invalid)
    refused(c, kafka, lambda: c.start_generation("nope", "q", "r", ACTOR), "unknown_sink", e.NotFound)


# --- no Kafka control plane ------------------------------------------------------------------


def test_unconfigured_control_plane_refuses_to_decide(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane
):
    gen = start(offline)
    offline.begin_checkpoint(NAME, 0, gen, ACTOR)
    x = lease_and_precommit(offline, 0, 1, gen, 0, 1)
    err = refused(offline, kafka, lambda: offline.commit(NAME, 0, 1, gen, [PR(0, x.id)], ACTOR),
                  e.NO_CONTROL_PLANE, e.Unavailable)
    assert err.status == 503
    d = offline.checkpoint_detail(NAME, 0)
    assert d.checkpoint.state is CheckpointState.OPEN and d.attempts[0].state is AttemptState.OPEN
    assert d.leases[0].state is LeaseState.PRECOMMITTED
    # with a control plane the same call decides and commits
    result = coordinator.commit(NAME, 0, 1, gen, [PR(0, x.id)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert_invariants(coordinator, settled=True)


def test_unconfigured_control_plane_cannot_finish_a_decided_commit(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane
):
    gen, winner, _ = _decided_but_unfinished(coordinator, kafka)
    refused(offline, kafka, lambda: offline.resume(NAME, 0), e.NO_CONTROL_PLANE, e.Unavailable)
    gen2, _ = offline.start_generation(NAME, "q1", "r2", ACTOR)
    with pytest.raises(e.Unavailable) as exc:
        offline.begin_checkpoint(NAME, 0, gen2, ACTOR)
    assert exc.value.reason == e.NO_CONTROL_PLANE
    assert offline.checkpoint_detail(NAME, 0).checkpoint.state is CheckpointState.COMMITTING
    assert coordinator.begin_checkpoint(NAME, 0, gen2, ACTOR).checkpoint.state is CheckpointState.COMMITTED
    assert_invariants(coordinator, settled=True)


# --- concurrent aborters ---------------------------------------------------------------------


class _GatedControlPlane(RecordingControlPlane):
    """Its aborts block until released, so a test can run another caller in between."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.log = log
        self.entered = threading.Event()
        self.release = threading.Event()

    def abort(self, target, transactional_id):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.release.wait(10)
        super().abort(target, transactional_id)
        self.log.append(("abort", transactional_id))


def test_a_stale_abort_never_hits_a_re_leased_id(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane, engine: Engine, clock: ManualClock
):
    """Two callers abort the same pending lease (say the recovery loop and a resume). The slow one
    must not send its abort-by-id after the fast one released the id and it was leased again: that
    would fence and abort the new lease's transaction."""
    gen = start(offline)
    offline.begin_checkpoint(NAME, 0, gen, ACTOR)
    stale = lease_and_precommit(offline, 0, 1, gen, 0, 1)
    _, outcome = offline.abort_attempt(NAME, 0, 1, gen, "driver_gave_up", ACTOR)
    assert outcome.pending == [stale.transactional_id]

    log: list[tuple[str, str]] = []
    gated = _GatedControlPlane(log)
    slow = Coordinator(engine, gated, clock=clock)
    try:
        worker = threading.Thread(target=slow.run_pending_aborts, args=(NAME,))
        worker.start()
        assert gated.entered.wait(10)  # the slow caller is inside its Kafka call
        fast = coordinator.run_pending_aborts(NAME)
        assert fast.aborted == [] and fast.pending == [stale.transactional_id]  # left to the slow one
        assert kafka.aborts == []
        assert pool(coordinator)[stale.transactional_id] is TransactionalIdState.LEASED
        coordinator.begin_checkpoint(NAME, 0, gen, ACTOR)
        fresh = [coordinator.begin_partition(NAME, 0, 2, gen, p, 10 + p) for p in range(2)]
        log.extend(("leased", x.transactional_id) for x in fresh)
        assert stale.transactional_id not in ids_of(fresh)
    finally:
        gated.release.set()
        worker.join(10)
        slow.close()
    for i, (kind, tid) in enumerate(log):
        if kind == "abort":
            assert ("leased", tid) not in log[:i], log
    assert gated.aborts == [(NAME, stale.transactional_id)] and kafka.aborts == []
    assert lease_state(coordinator, stale.id) is LeaseState.ABORTED
    # the id is free again only now (after its quarantine), and the next lease reuses it
    clock.advance(ms=QUARANTINE_MS)
    assert coordinator.begin_partition(NAME, 0, 2, gen, 0, 99).transactional_id == stale.transactional_id
    assert coordinator.run_pending_aborts(NAME) == type(outcome)()
    assert_invariants(coordinator)


def test_sink_overviews_answer_as_the_per_sink_reads(coordinator: Coordinator, kafka: RecordingControlPlane):
    """The dashboard overview's bulk read gives each sink what the per-sink reads give: the newest
    checkpoints of its current lineage only (an earlier lineage's commits are not its last commit),
    at most `recent` of them, and its possibly open transactions."""
    c = coordinator

    def commit_batches(name: str, gen: int, batches: range) -> None:
        for b in batches:
            c.begin_checkpoint(name, b, gen, ACTOR)
            x = lease_and_precommit(c, b, 1, gen, 0, 100 + b, name=name)
            c.commit(name, b, 1, gen, [PR(0, x.id)], ACTOR)

    g1 = start(c, query="q1")
    commit_batches(NAME, g1, range(3))
    c.reset_lineage(NAME, "operator", "new checkpoint location")
    g2, _ = c.start_generation(NAME, "q2", "r2", ACTOR)
    c.begin_checkpoint(NAME, 0, g2, ACTOR)
    lease_and_precommit(c, 0, 1, g2, 0, 1)  # the new lineage's first batch, open
    other = start(c, name="busy", prefix="busy-eos")
    commit_batches("busy", other, range(7))
    c.begin_checkpoint("busy", 7, other, ACTOR)
    c.register_sink(spec(name="idle", prefix="idle-eos"), ACTOR)

    overviews = c.sink_overviews(recent=5)
    assert [o.sink.name for o in overviews] == ["busy", "idle", NAME]
    for o in overviews:
        name = o.sink.name
        committed = c.list_checkpoints(name, state=CheckpointState.COMMITTED, limit=1)
        assert o.sink == c.get_sink(name)
        assert o.recent == [(d.checkpoint, d.attempts) for d in c.checkpoint_history(name, limit=5)]
        assert o.last_committed == (committed[0] if committed else None)
        unresolved = c.possibly_open_transactions(name)
        assert o.open_transactions == len(unresolved)
        assert o.near_timeout_candidates == [x for x in unresolved if x.state in recovery_rules.NEAR_TIMEOUT_STATES]
    busy, idle, orders = overviews
    assert [cp.batch_id for cp, _ in busy.recent] == [7, 6, 5, 4, 3] and busy.last_committed.batch_id == 6
    assert busy.open_transactions == 0 and idle.recent == [] and idle.last_committed is None
    assert [(cp.query_id, cp.batch_id) for cp, _ in orders.recent] == [("q2", 0)]
    assert orders.last_committed is None and [x.state for x in orders.near_timeout_candidates] == [LeaseState.PRECOMMITTED]
    # a wide batch in flight: its leased first tries are counted, not loaded
    c.begin_checkpoint("busy", 8, other, ACTOR, partitions=40)
    busy, _, orders = c.sink_overviews(recent=5)
    assert busy.open_transactions == 40 and busy.near_timeout_candidates == []
    assert orders.open_transactions == 1 and len(orders.near_timeout_candidates) == 1


def test_open_transactions_in_brief_count_all_and_load_the_oldest_and_the_deciding(
        coordinator: Coordinator, clock: ManualClock) -> None:
    """A sink page's read: the count of possibly open transactions, the `oldest` of them by lease
    time, and every one the near-timeout rule reads, without loading a wide batch's first tries."""
    c = coordinator
    gen = start(c)
    begun = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=40)
    clock.advance(ms=1_000)
    retry = lease_and_precommit(c, 0, begun.attempt.number, gen, 3, 77)  # leased a second later: the newest
    brief = c.open_transactions_in_brief(NAME, 5)
    every = c.possibly_open_transactions(NAME)
    assert brief.count == len(every) == 41
    assert brief.oldest == sorted(every, key=lambda x: (x.leased_at, x.id))[:5] == begun.pre_leases[:5]
    assert brief.near_timeout_candidates == [retry]
    assert c.open_transactions_in_brief(NAME, 50).oldest[-1] == retry


def test_a_pass_over_kafka_stops_starting_calls_once_the_broker_answered_none(engine: Engine) -> None:
    """A broker that does not answer costs each call its whole retry budget (8 s): 4,096 winners,
    16 at a time, would hold a commit call or the recovery loop for 34 minutes. Once one call got
    no answer and none got one, the calls not started yet are reported not tried (retriable: they
    stay pending for the next pass). A refusal is an answer: after one, every call is made
    (test_lost_data's one refused winner that does not stop the others)."""
    unreachable = ControlPlaneError("broker down", retriable=True, code="broker_unreachable")
    kafka = RecordingControlPlane()
    c = Coordinator(engine, kafka, limits=Limits(kafka_parallelism=4))
    try:
        gen = start(c)
        c.begin_checkpoint(NAME, 0, gen, ACTOR)
        winners = [lease_and_precommit(c, 0, 1, gen, p, p) for p in range(40)]
        kafka.fail_next(unreachable, times=1_000)
        with pytest.raises(e.Unavailable) as answer:
            c.commit(NAME, 0, 1, gen, [PR(p, w.id) for p, w in enumerate(winners)], ACTOR)
        tried = 1_000 - len(kafka._failures)
        assert 1 <= tried <= 4  # the calls already running when the first gave up, no more
        # the event and the answer name each tried call's error and count the others
        (failed,) = [ev for ev in c.list_events(NAME, limit=1000) if ev["kind"] == "commit_failed"]
        assert len(failed["detail"]["failures"]) == tried and failed["detail"]["not_tried"] == 40 - tried
        assert answer.value.detail["not_tried"] == 40 - tried and len(answer.value.detail["failures"]) == tried
        assert f"40 transaction(s) could not be committed on Kafka yet ({40 - tried} not tried" in answer.value.message
        assert {lease_state(c, w.id) for w in winners} == {LeaseState.COMMITTING}

        kafka.clear_failures()  # the broker is back: the next pass commits every winner
        assert c.resume(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
        assert len(kafka.commits) == 40

        # an abort pass (a stage retry's 40 first tries) stops the same way
        c.begin_checkpoint(NAME, 1, gen, ACTOR)
        tries = [c.begin_partition(NAME, 1, 1, gen, p, 100 + p) for p in range(40)]
        kafka.fail_next(unreachable, times=1_000)
        _, outcome = c.abort_attempt(NAME, 1, 1, gen, "stage retry", ACTOR)
        tried = 1_000 - len(kafka._failures)
        assert 1 <= tried <= 4 and outcome.aborted == [] and len(outcome.pending) == 40
        (failed,) = [ev for ev in c.list_events(NAME, limit=1000) if ev["kind"] == "abort_failed"]
        assert len(failed["detail"]["failures"]) == tried and failed["detail"]["not_tried"] == 40 - tried
        kafka.clear_failures()
        assert sorted(c.run_pending_aborts(NAME).aborted) == sorted(x.transactional_id for x in tries)
    finally:
        c.close()


class PassingPlane(RecordingControlPlane):
    """A control plane that makes whole passes (commit_all, abort_all), as the wire plane does:
    records each pass and answers the outcomes queued in `answers` (else success)."""

    def __init__(self) -> None:
        super().__init__()
        self.passes: list[tuple[str, list[str], int, bool]] = []
        self.answers: list[list[CallOutcome]] = []

    def _pass(self, kind: str, ids: list[str], parallelism: int) -> list[CallOutcome]:
        self.passes.append((kind, ids, parallelism, on_loop.on_loop()))
        return self.answers.pop(0) if self.answers else [CallOutcome(None, 0.01) for _ in ids]

    def commit_all(self, target: KafkaTarget, txns: list[PreparedTransaction], parallelism: int) -> list[CallOutcome]:
        return self._pass("commit", [t.transactional_id for t in txns], parallelism)

    def abort_all(self, target: KafkaTarget, ids: list[str], parallelism: int) -> list[CallOutcome]:
        return self._pass("abort", list(ids), parallelism)


def test_a_plane_that_makes_passes_gets_each_pass_whole_and_its_outcomes_decide(engine: Engine) -> None:
    """The service hands a batch's winners to commit_all in one call (and an attempt's tries to
    abort_all), never to the per-transaction calls, and reads each transaction's outcome from the
    pass: one NOT_TRIED leaves its winner pending (the commit answers 503 and counts it), a later
    pass commits it."""
    plane = PassingPlane()
    c = Coordinator(engine, plane, limits=Limits(kafka_parallelism=3))
    try:
        gen = start(c)
        c.begin_checkpoint(NAME, 0, gen, ACTOR)
        winners = [lease_and_precommit(c, 0, 1, gen, p, p) for p in range(5)]
        not_tried = ControlPlaneError("not tried in this pass", retriable=True, code=NOT_TRIED)
        plane.answers.append([CallOutcome(None, 0.01)] * 4 + [CallOutcome(not_tried)])
        with pytest.raises(e.Unavailable) as answer:
            c.commit(NAME, 0, 1, gen, [PR(p, w.id) for p, w in enumerate(winners)], ACTOR)
        assert plane.passes == [("commit", [w.transactional_id for w in winners], 3, False)]
        assert plane.commits == [] and answer.value.detail["not_tried"] == 1
        assert [lease_state(c, w.id) for w in winners] == [LeaseState.COMMITTED] * 4 + [LeaseState.COMMITTING]
        assert c.resume(NAME, 0).checkpoint.state is CheckpointState.COMMITTED
        assert plane.passes[1] == ("commit", [winners[4].transactional_id], 3, False)

        c.begin_checkpoint(NAME, 1, gen, ACTOR)
        tries = [c.begin_partition(NAME, 1, 1, gen, p, 100 + p) for p in range(4)]
        _, outcome = c.abort_attempt(NAME, 1, 1, gen, "stage retry", ACTOR)
        assert plane.passes[2] == ("abort", [x.transactional_id for x in tries], 3, False)
        assert plane.aborts == [] and sorted(outcome.aborted) == sorted(x.transactional_id for x in tries)
    finally:
        c.close()


def test_a_pass_called_on_the_event_loop_runs_in_a_thread(engine: Engine) -> None:
    """A commit answered on the event loop (the fast lane) hands the pass to a Kafka thread: the
    control plane blocks on the broker, the loop must not."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from coordinator.service import kafka_passes

    plane = PassingPlane()
    txns = [PreparedTransaction(f"t{i}", i, 0) for i in range(3)]
    with ThreadPoolExecutor(2) as pool:
        outcomes = asyncio.run(on_loop.run_on_loop(
            lambda: kafka_passes.commit_pass(pool, 2, plane, KafkaTarget("s", "b:9", 60_000), txns)))
    assert [o.error for o in outcomes] == [None] * 3
    assert plane.passes == [("commit", ["t0", "t1", "t2"], 2, False)]


def test_kafka_work_runs_at_most_kafka_parallelism_at_once_with_results_in_order(engine: Engine) -> None:
    """_parallel (each lease's commit or abort on Kafka): every item once, answers in the items'
    order, never more than kafka_parallelism at once."""
    import time as _time

    c = Coordinator(engine, RecordingControlPlane(), limits=Limits(kafka_parallelism=4))
    running, peak, lock, seen = 0, 0, threading.Lock(), []

    def work(x: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            seen.append(x)
        _time.sleep(0.3 if x == 0 else 0.01)
        with lock:
            running -= 1
        return x * 10

    try:
        assert c._parallel(work, list(range(40))) == [x * 10 for x in range(40)]  # type: ignore[arg-type]
        with pytest.raises(ZeroDivisionError):
            c._parallel(lambda x: 1 // (x - 3), list(range(8)))  # type: ignore[arg-type,operator]
    finally:
        c.close()
    assert sorted(seen) == list(range(40)) and peak == 4
