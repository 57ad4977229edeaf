"""Pre-leases are single-use and claimed at the coordinator (issue 50 §2, §5.2), records come with
the commit, ids are quarantined before reuse, and one clock decides: through `Coordinator` on a
real Postgres; Kafka is the record-only control plane, or the simulation's Kafka model where what
a zombie producer does to a transaction is the point (the real-broker suites show the model is
faithful); the calls a batch costs are counted over real HTTP.

PySpark's TaskContext has no stage attempt number, so an executor cannot tell a resubmitted
stage's try from a first try: the coordinator decides. The first try to ask claims its partition's
pre-lease with Spark's task attempt id; every other try gets an id of its own; a record names the
try that wrote it and is refused unless that try holds the lease; an id a try held that did not win
is quarantined before any later batch may take it; a pre-lease no try claimed is freed at once."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

import coordinator.service.clock as clock_module
from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane, TransactionOutcome
from coordinator.protocol import errors as e
from coordinator.protocol.model import FIRST_OFFSETS_KEPT, Lease, PartitionResult, PrecommitRecord
from coordinator.protocol.states import CheckpointState, LeaseState
from coordinator.service import Coordinator, Limits
from coordinator.service.clock import ManualClock
from coordinator.store import events
from coordinator.store.db import make_engine
from fixtures.protocol_calls import (  # noqa: F401 - fixtures
    ACTOR,
    NAME,
    PREFIX,
    QUARANTINE_MS,
    assert_invariants,
    claimed,
    empty,
    held,
    ids_of,
    invariants_hold_at_the_end,
    lease_of,
    quarantined,
    record,
    refused,
    start,
    won,
)
from fixtures.servers import ServiceProcess, Winner
from sim.kafka_model import KafkaModel, ModelControlPlane


# --- §2: a second try never gets the pre-lease ------------------------------------------------


def test_a_second_try_on_a_partition_never_gets_its_pre_lease(coordinator: Coordinator, kafka: RecordingControlPlane):
    """Stage attempt 0 and a resubmitted stage's try of partition 0 both run (and would both say
    stage attempt 0): the first to ask claims the pre-lease, the other gets an id of its own, and
    each retried request answers its own lease."""
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    (pre,) = [x for x in c.checkpoint_detail(NAME, 0).leases if x.partition == 0]
    old_stage = c.lease(NAME, 0, 1, gen, 0, 17).lease
    new_stage = c.lease(NAME, 0, 1, gen, 0, 4242).lease
    assert old_stage.id == pre.id and old_stage.transactional_id == pre.transactional_id
    assert new_stage.id != pre.id and new_stage.transactional_id != pre.transactional_id
    assert c.lease(NAME, 0, 1, gen, 0, 17).lease == old_stage
    assert c.lease(NAME, 0, 1, gen, 0, 4242).lease == new_stage
    # the pre-lease stays the first try's: no third try claims it
    third = c.lease(NAME, 0, 1, gen, 0, 5000).lease
    assert len({old_stage.transactional_id, new_stage.transactional_id, third.transactional_id}) == 3
    assert lease_of(c, pre.id).task_attempt_id == 17


def test_a_record_from_a_try_that_did_not_claim_the_lease_is_refused(coordinator: Coordinator,
                                                                    kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    old_stage = c.lease(NAME, 0, 1, gen, 0, 17).lease
    new_stage = c.lease(NAME, 0, 1, gen, 0, 4242).lease
    one = c.lease(NAME, 0, 1, gen, 1, 18).lease
    # the new stage's try reports the pre-lease (it took itself for the first try): not its lease
    mixed = PartitionResult(0, old_stage.id, record(new_stage))
    err = refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [mixed, won(one)], ACTOR), e.LEASE_NOT_CLAIMED)
    assert err.detail == {"lease_id": old_stage.id, "holder": 17, "reported_by": 4242}
    # the driver sends the new stage's try's record on its own lease: committed, the old try ended
    result = c.commit(NAME, 0, 1, gen, [won(new_stage), won(one)], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert kafka.aborts == [(NAME, old_stage.transactional_id)]
    assert_invariants(c, settled=True)


def test_a_record_for_a_pre_lease_no_try_claimed_is_refused_lease_not_claimed(
        coordinator: Coordinator, kafka: RecordingControlPlane):
    """A try that wrote on a pre-lease without claiming it (a client that guesses "first try"
    itself) is refused with the claim's reason: the lease is not held by the try the record names."""
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    (pre,) = c.checkpoint_detail(NAME, 0).leases
    guessed = PartitionResult(0, pre.id, PrecommitRecord(17, 2000, 0, 5, 50))
    refused(c, kafka, lambda: c.commit(NAME, 0, 1, gen, [guessed], ACTOR), e.LEASE_NOT_CLAIMED)


def test_an_id_whose_claimed_try_did_not_win_is_quarantined_not_handed_to_the_next_batch(
        coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    old_stage = c.lease(NAME, 0, 1, gen, 0, 17).lease  # claims the pre-lease; its stage then fails
    new_stage = c.lease(NAME, 0, 1, gen, 0, 4242).lease
    c.commit(NAME, 0, 1, gen, [won(new_stage)], ACTOR)
    assert lease_of(c, old_stage.id).state is LeaseState.ABORTED  # aborted on Kafka: it may have written
    assert kafka.aborts == [(NAME, old_stage.transactional_id)]
    assert quarantined(c, clock.now()) == {old_stage.ordinal}
    # the following batches, wide enough to want every id, never get it during the quarantine
    for batch in (1, 2):
        clock.advance(ms=QUARANTINE_MS // 3)
        c.begin_checkpoint(NAME, batch, gen, ACTOR, partitions=4)
        tries = claimed(c, batch, 1, gen, 4)
        assert old_stage.transactional_id not in ids_of(tries)
        c.commit(NAME, batch, 1, gen, [won(x) for x in tries], ACTOR)
    clock.advance(ms=QUARANTINE_MS)
    c.begin_checkpoint(NAME, 3, gen, ACTOR, partitions=5)
    assert old_stage.transactional_id in ids_of(claimed(c, 3, 1, gen, 5))  # back once it ended
    assert_invariants(c)


# --- §5.2: an empty partition's pre-lease ------------------------------------------------------


def test_an_empty_partitions_pre_lease_is_freed_at_once_when_no_try_claimed_it(
        coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    (first,) = claimed(c, 0, 1, gen, 1)
    (unused,) = [x for x in c.checkpoint_detail(NAME, 0).leases if x.partition == 1]
    c.commit(NAME, 0, 1, gen, [won(first), empty(1)], ACTOR)
    assert kafka.aborts == [] and len(kafka.commits) == 1
    freed = lease_of(c, unused.id)
    assert freed.state is LeaseState.ABORTED and freed.producer_id is None and freed.resolved_at == clock.now()
    assert quarantined(c) == set()  # no producer ever used it: no quarantine
    # the next batch may take it at once
    c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2)
    assert unused.transactional_id in held(c)
    assert_invariants(c)


def test_an_empty_partitions_pre_lease_a_try_claimed_is_aborted_and_quarantined(
        coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    """With non-deterministic input (failOnDataLoss=false, retention deleting records between
    tries), a try may have written on the pre-lease though the driver reports the partition empty."""
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    first, wrote = claimed(c, 0, 1, gen, 2)
    c.commit(NAME, 0, 1, gen, [won(first), empty(1)], ACTOR)
    assert kafka.aborts == [(NAME, wrote.transactional_id)]
    assert lease_of(c, wrote.id).state is LeaseState.ABORTED
    assert quarantined(c, clock.now()) == {wrote.ordinal}
    c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2)
    assert wrote.transactional_id not in held(c)
    assert_invariants(c)


# --- a zombie try on the simulation's Kafka model ---------------------------------------------


@pytest.fixture
def model(engine: Engine) -> Any:
    clock = ManualClock()
    kafka_model = KafkaModel(clock)
    c = Coordinator(engine, ModelControlPlane(kafka_model), clock=clock, limits=Limits(kafka_parallelism=1))
    yield c, kafka_model, clock
    c.close()


def write(kafka_model: KafkaModel, x: Lease, value: str) -> PrecommitRecord:
    """A task try: init its producer on its lease's id, write one record, flush; its record."""
    pid, epoch = kafka_model.init_producer_id(x.transactional_id, 60_000)
    offset = kafka_model.produce(x.transactional_id, pid, epoch, "out", 0, value)
    return PrecommitRecord(x.task_attempt_id, pid, epoch, 1, len(value), first_offsets=[["out", 0, offset]])  # type: ignore[arg-type]


def test_a_zombie_try_can_no_longer_fence_the_next_batch(model: Any) -> None:
    """The finding (issue 50 §2 b): a try stalls before init_transactions on the pre-lease; a
    resubmitted stage's try wins; its id is freed at once; the next batch's first try takes that
    id and writes; the stalled try's InitProducerId then reaches the broker and fences the next
    batch (LOST). Now the two tries had two ids, the stalled one's is quarantined, and its late
    init fences nobody."""
    c, kafka_model, clock = model
    gen = start(c, transaction_timeout_ms=60_000, commit_margin_ms=6_000)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    stalled = c.lease(NAME, 0, 1, gen, 0, 17).lease  # claims the pre-lease, then stalls
    winner = c.lease(NAME, 0, 1, gen, 0, 4242).lease
    c.commit(NAME, 0, 1, gen, [PartitionResult(0, winner.id, write(kafka_model, winner, "batch0"))], ACTOR)
    assert quarantined(c, clock.now()) == {stalled.ordinal}

    clock.advance(seconds=1)
    c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=1)
    (nxt,) = claimed(c, 1, 1, gen, 1)
    assert nxt.transactional_id != stalled.transactional_id
    rec = write(kafka_model, nxt, "batch1")
    kafka_model.init_producer_id(stalled.transactional_id, 60_000)  # the zombie's InitProducerId lands now
    done = c.commit(NAME, 1, 1, gen, [PartitionResult(0, nxt.id, rec)], ACTOR)
    assert done.checkpoint.state is CheckpointState.COMMITTED
    assert kafka_model.read_committed("out") == ["batch0", "batch1"]
    assert_invariants(c, settled=True)


@pytest.mark.parametrize("reported", ["old stage", "new stage"])
def test_both_tries_of_a_resubmitted_stage_write_and_either_record_commits_exactly_once(
        model: Any, reported: str) -> None:
    """The finding (issue 50 §2 a): both tries ran to completion on the one pre-lease; the old
    try's record was accepted while the new try had re-initialised the id: data_lost, the sink
    halted. Now each try wrote on its own id, so whichever record the driver got commits, and the
    other try's transaction is aborted: the batch is in the log once."""
    c, kafka_model, clock = model
    gen = start(c, transaction_timeout_ms=60_000, commit_margin_ms=6_000)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    old = c.lease(NAME, 0, 1, gen, 0, 17).lease
    new = c.lease(NAME, 0, 1, gen, 0, 4242).lease
    old_record = write(kafka_model, old, "from the old stage")
    new_record = write(kafka_model, new, "from the new stage")
    x, rec = (old, old_record) if reported == "old stage" else (new, new_record)
    done = c.commit(NAME, 0, 1, gen, [PartitionResult(0, x.id, rec)], ACTOR)
    assert done.checkpoint.state is CheckpointState.COMMITTED and not c.get_sink(NAME).halted
    assert kafka_model.read_committed("out") == [f"from the {reported}"]
    assert_invariants(c, settled=True)


# --- records come with the commit ----------------------------------------------------------------


def test_the_decision_and_its_records_are_durable_together(coordinator: Coordinator, kafka: RecordingControlPlane,
                                                           monkeypatch: pytest.MonkeyPatch):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    first = claimed(c, 0, 1, gen, 2)
    results = [won(x, write_ms=7, first_offsets=[["out", x.partition, 40 + x.id]]) for x in first]

    # the coordinator dies inside the decision's transaction (after the records were written):
    # nothing of it stuck, no record without its decision
    real_add = events.add

    def die_at_the_decisions_event(conn: Any, sink_id: int, kind: str, *args: Any, **kw: Any) -> None:
        real_add(conn, sink_id, kind, *args, **kw)
        if kind == "commit_decided":
            raise RuntimeError("the coordinator died")

    with monkeypatch.context() as patched, pytest.raises(RuntimeError):
        patched.setattr(events, "add", die_at_the_decisions_event)
        c.commit(NAME, 0, 1, gen, results, ACTOR)
    snap = c.snapshot()
    assert {x.state for x in snap.leases} == {LeaseState.LEASED}
    assert {x.producer_id for x in snap.leases} == {None}
    assert snap.checkpoints[0].state is CheckpointState.OPEN and kafka.commits == []

    # it dies right after the decision committed, before any Kafka call: decision and records together
    with monkeypatch.context() as patched, pytest.raises(RuntimeError):
        patched.setattr(c.committer, "finish_decision", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("died")))
        c.commit(NAME, 0, 1, gen, results, ACTOR)
    stored = {x.id: x for x in c.snapshot().leases}
    assert {x.state for x in stored.values()} == {LeaseState.COMMITTING}
    assert c.snapshot().checkpoints[0].state is CheckpointState.COMMITTING and kafka.commits == []
    for x, r in zip(first, results):
        s, p = stored[x.id], r.precommit
        assert (s.producer_id, s.producer_epoch, s.records, s.bytes, s.write_ms, json.loads(s.first_offsets or "")) == (
            p.producer_id, p.producer_epoch, p.records, p.bytes, 7, [["out", x.partition, 40 + x.id]])

    done = c.commit(NAME, 0, 1, gen, results, ACTOR)  # a retry finishes the decided commit
    assert done.checkpoint.state is CheckpointState.COMMITTED
    assert sorted((t.transactional_id, t.producer_id, t.producer_epoch) for _, t in kafka.commits) == sorted(
        (x.transactional_id, 1000 + x.id, 0) for x in first)
    assert c.commit(NAME, 0, 1, gen, results, ACTOR).checkpoint == done.checkpoint
    assert len(kafka.commits) == 2
    assert_invariants(c, settled=True)


def test_a_refused_commit_looks_in_the_log_at_the_first_offsets_its_record_carried(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    (only,) = claimed(c, 0, 1, gen, 1)
    offsets = [["out", 0, 41], ["out", 3, 9], ["other", 1, 12345678901]]
    kafka.fail_next(ControlPlaneError("EndTxn: PRODUCER_FENCED", retriable=False, code="producer_fenced"))
    kafka.outcomes[only.transactional_id] = TransactionOutcome.COMMITTED  # the log shows it committed after all
    done = c.commit(NAME, 0, 1, gen, [won(only, first_offsets=offsets)], ACTOR)
    assert done.checkpoint.state is CheckpointState.COMMITTED
    assert kafka.outcome_reads == [(only.transactional_id, tuple(tuple(x) for x in offsets))]
    assert_invariants(c, settled=True)


def test_the_commit_gate_applies_to_records_that_come_with_the_commit(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen = start(c, transaction_timeout_ms=60_000, commit_margin_ms=6_000)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    (first,) = claimed(c, 0, 1, gen, 1)
    clock.advance(ms=54_001)  # 5,999 ms left: inside the margin
    with pytest.raises(e.Conflict) as refused_:
        c.commit(NAME, 0, 1, gen, [won(first)], ACTOR)
    assert refused_.value.reason == e.DEADLINE_TOO_CLOSE
    assert kafka.commits == [] and kafka.aborts == [(NAME, first.transactional_id)]
    assert_invariants(c, settled=True)


def test_a_quarantine_shorter_than_a_try_can_reach_the_broker_is_refused(engine: Engine):
    with pytest.raises(e.Invalid) as refused_:
        Coordinator(engine, None, limits=Limits(lease_max_init_age_ms=30_000, producer_init_timeout_ms=60_000,
                                                producer_request_timeout_ms=60_000,
                                                transactional_id_quarantine_ms=150_000))
    assert refused_.value.reason == "transactional_id_quarantine_too_short"


# --- one clock --------------------------------------------------------------------------------


class _SkewedDatetime(datetime):
    skew = timedelta(0)

    @classmethod
    def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + cls.skew


def test_a_replica_clock_10_s_off_changes_no_decision(engine: Engine, kafka: RecordingControlPlane,
                                                      monkeypatch: pytest.MonkeyPatch):
    """Two replicas with the default clock: one grants the lease while the host clock runs 10 s
    ahead, the other decides while it runs 10 s behind. The lease times and the gate are the
    database's, so the commit past the margin is refused all the same."""
    monkeypatch.setattr(clock_module, "datetime", _SkewedDatetime)
    granting, deciding = Coordinator(engine, kafka), Coordinator(engine, kafka)
    try:
        _SkewedDatetime.skew = timedelta(seconds=10)
        gen = start(granting, transaction_timeout_ms=2_500, commit_margin_ms=1_000)
        granting.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
        with engine.connect() as conn:
            db_before = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        (lease,) = claimed(granting, 0, 1, gen, 1)
        with engine.connect() as conn:
            db_after = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        assert db_before <= lease.leased_at <= db_after  # the database's time, not the host's
        assert lease.deadline_at == lease.leased_at + timedelta(milliseconds=2_500)

        _SkewedDatetime.skew = timedelta(seconds=-10)
        while datetime.now(UTC) < lease.leased_at + timedelta(milliseconds=1_600):
            time.sleep(0.05)
        with pytest.raises(e.Conflict) as refused_:
            deciding.commit(NAME, 0, 1, gen, [won(lease)], ACTOR)
        assert refused_.value.reason == e.DEADLINE_TOO_CLOSE and kafka.commits == []
        assert_invariants(deciding, settled=True)
    finally:
        granting.close()
        deciding.close()


# --- the calls a batch costs, over real HTTP ---------------------------------------------------


def test_a_batch_costs_begin_a_lease_per_try_with_rows_and_commit(database_url: str, tmp_path: Path):
    with ServiceProcess(database_url, "admin-secret", tmp_path) as svc:
        admin = svc.client("admin-secret")
        registered = admin.register_sink(NAME, PREFIX, bootstrap_servers="kafka:9092", expect=201)
        client = svc.client(registered["writer_token"])
        calls: list[str] = []
        client.http.event_hooks["request"] = [lambda r: calls.append(r.url.path)]
        gen = client.start_generation(NAME, "q1", "r1")["generation"]

        def batch(batch_id: int, retried: bool, topic_partitions: int = 1) -> dict[str, Any]:
            calls.clear()
            begun = client.begin(NAME, batch_id, gen, partitions=3, offsets=f"sha256:{batch_id:04x}")
            assert begun["pre_leased"] == 3 and begun["max_lease_init_age_ms"] == 30_000
            winners: dict[int, Winner | None] = {2: None}  # partition 2 is empty: no lease call
            for p in (0, 1):
                lease = client.lease(NAME, batch_id, begun["attempt"], gen, p, 100 * batch_id + p)
                if retried and p == 1:  # partition 1's first try failed: its retry leases its own id
                    lease = client.lease(NAME, batch_id, begun["attempt"], gen, p, 900 + batch_id)
                winners[p] = Winner.of(lease, 10 + p, records=3, bytes=30, write_ms=1,
                                       first_offsets=[("out", k, 100 + p) for k in range(topic_partitions)])
            return client.commit(NAME, batch_id, begun["attempt"], gen, winners, job_ms=5)

        answer = batch(0, retried=False)
        assert answer["state"] == "COMMITTED" and len(answer["committed"]) == 2
        assert len(calls) == 4, calls  # begin, a lease per partition with rows, commit
        assert batch(1, retried=True)["state"] == "COMMITTED"
        assert len(calls) == 5, calls  # and one more for the retried try
        # a writer reporting every topic-partition its transaction wrote: the coordinator keeps the
        # first FIRST_OFFSETS_KEPT as sent
        assert batch(2, retried=True, topic_partitions=10)["state"] == "COMMITTED"
        engine = make_engine(database_url)
        try:
            with engine.connect() as conn:
                stored = conn.execute(text(
                    "SELECT l.partition, l.first_offsets FROM leases AS l JOIN checkpoints AS c "
                    "ON c.id = l.checkpoint_id WHERE c.batch_id = 2 AND l.state = 'COMMITTED' ORDER BY l.partition"
                )).all()
        finally:
            engine.dispose()
        assert [(p, json.loads(f)) for p, f in stored] == [
            (p, [["out", k, 100 + p] for k in range(FIRST_OFFSETS_KEPT)]) for p in (0, 1)]
        client.close()
        admin.close()
