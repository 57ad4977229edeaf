"""The two-calls-per-batch protocol (DESIGN §3 Revisions) and the hardening that came with it
(issue 15 items 1-3): pre-leases at begin, pre-commit records with the commit, the id pool's
quarantine, one clock (the database's), and a batch bound to its offsets. Real Postgres per test
(conftest.py); Kafka is the record-only control plane, or the simulation's Kafka model where what
a zombie producer does to a transaction is the point (the real-broker suites show the model is
faithful)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, select, text

import coordinator.service.clock as clock_module
from coordinator.service.clock import ManualClock
from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane, TransactionOutcome
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import FIRST_OFFSETS_KEPT, FIRST_TRY_TASK_ATTEMPT, PartitionResult, PrecommitRecord
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import CheckpointState, LeaseState, TransactionalIdState
from coordinator.service import Coordinator, Limits, SinkSpec
from coordinator.store import driver_sql, hot_path
from coordinator.store.db import make_engine
from coordinator.store.tables import transactional_ids
from fixtures.servers import ServiceProcess
from sim.kafka_model import KafkaModel, ModelControlPlane
from sparkclient.client import CoordinatorClient

NAME, PREFIX, ACTOR = "orders", "orders-eos", "test"
QUARANTINE_MS = Limits().transactional_id_quarantine_ms


def start(c: Coordinator, **kw: Any) -> int:
    c.register_sink(SinkSpec(NAME, PREFIX, "kafka:9092", ["out"], **kw), ACTOR)
    gen, _ = c.start_generation(NAME, "q1", "r1", ACTOR)
    return gen


def record(lease_id: int, records: int = 5) -> PrecommitRecord:
    return PrecommitRecord(2000 + lease_id, 0, records, records * 10, 7, [["out", 0, 40 + lease_id]])


def pool(c: Coordinator) -> dict[str, tuple[TransactionalIdState, datetime | None]]:
    with c.engine.connect() as conn:
        rows = conn.execute(select(transactional_ids.c.transactional_id, transactional_ids.c.state,
                                   transactional_ids.c.reusable_at)).all()
    return {r.transactional_id: (TransactionalIdState(r.state), r.reusable_at) for r in rows}


def assert_invariants(c: Coordinator, *, settled: bool = False) -> None:
    assert [str(v) for v in check_invariants(c.snapshot(), settled=settled)] == []


# --- item 1 of the protocol change: begin pre-leases the first tries -----------------------------


def test_begin_pre_leases_each_first_try_durably_and_a_retry_answers_the_same(coordinator: Coordinator,
                                                                             kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    begun = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3)
    assert begun.action is BeginAction.NEW_ATTEMPT and begun.attempt.partitions == 3
    assert [x.partition for x in begun.pre_leases] == [0, 1, 2]
    assert {x.task_attempt_id for x in begun.pre_leases} == {FIRST_TRY_TASK_ATTEMPT}
    assert len({x.transactional_id for x in begun.pre_leases}) == 3
    assert begun.lease_rules == dict(commit_margin_ms=6_000, max_lease_init_age_ms=30_000,
                                     producer_init_timeout_ms=60_000, producer_request_timeout_ms=60_000)
    # durable with the attempt: the pool holds each id for its lease (I3) before any producer exists
    held = pool(c)
    assert all(held[x.transactional_id][0] is TransactionalIdState.LEASED for x in begun.pre_leases)
    before = c.snapshot()
    again = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3)  # a retried begin
    assert again.action is BeginAction.CONTINUE and again.pre_leases == begun.pre_leases
    assert c.snapshot().leases == before.leases  # no second effect
    # a begin without a partition count (an older client) gets no pre-leases
    c.begin_checkpoint(NAME, 1, gen, ACTOR)
    assert c.begin_checkpoint(NAME, 1, gen, ACTOR).pre_leases == []
    assert_invariants(c)


def test_a_speculative_copy_gets_its_own_lease_and_the_first_try_loses(coordinator: Coordinator,
                                                                       kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    first = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2).pre_leases
    copy = c.begin_partition(NAME, 0, 1, gen, 0, 77)  # a speculative copy (task attempt 1) of partition 0
    assert copy.transactional_id not in {x.transactional_id for x in first}
    with pytest.raises(e.Invalid):  # the first tries' marker is not a task attempt id a client may use
        c.begin_partition(NAME, 0, 1, gen, 0, FIRST_TRY_TASK_ATTEMPT)
    result = c.commit(NAME, 0, 1, gen, [PartitionResult(0, copy.id, record(copy.id)),
                                        PartitionResult(1, first[1].id, record(first[1].id))], ACTOR)
    assert result.checkpoint.state is CheckpointState.COMMITTED
    assert sorted(t.transactional_id for _, t in kafka.commits) == sorted([copy.transactional_id,
                                                                          first[1].transactional_id])
    # the losing first try is aborted on Kafka and its id quarantined (it may still be alive)
    assert kafka.aborts == [(NAME, first[0].transactional_id)]
    state, reusable_at = pool(c)[first[0].transactional_id]
    assert state is TransactionalIdState.FREE and reusable_at is not None
    assert_invariants(c, settled=True)


def test_an_empty_partitions_pre_lease_is_freed_without_touching_kafka(coordinator: Coordinator,
                                                                       kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    first = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2).pre_leases
    c.commit(NAME, 0, 1, gen, [PartitionResult(0, first[0].id, record(first[0].id)), PartitionResult(1, None)], ACTOR)
    assert kafka.aborts == [] and len(kafka.commits) == 1
    by_id = {x.id: x for x in c.snapshot().leases}
    assert by_id[first[1].id].state is LeaseState.ABORTED and by_id[first[1].id].producer_id is None
    assert pool(c)[first[1].transactional_id] == (TransactionalIdState.FREE, None)  # no quarantine
    assert_invariants(c, settled=True)


# --- item 2: the commit carries the winners' records -----------------------------------------------


def test_a_refused_commit_looks_in_the_log_at_the_first_offsets_its_record_carried(
    coordinator: Coordinator, kafka: RecordingControlPlane
):
    # stored as the JSON text the commit carried, parsed only on this path (migration 0009)
    c = coordinator
    gen = start(c)
    (only,) = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1).pre_leases
    offsets = [["out", 0, 41], ["out", 3, 9], ["other", 1, 12345678901]]
    kafka.fail_next(ControlPlaneError("EndTxn: PRODUCER_FENCED", retriable=False, code="producer_fenced"))
    kafka.outcomes[only.transactional_id] = TransactionOutcome.COMMITTED  # the log shows it committed after all
    r = PrecommitRecord(2000, 0, 5, 50, 7, offsets)
    done = c.commit(NAME, 0, 1, gen, [PartitionResult(0, only.id, r)], ACTOR)
    assert done.checkpoint.state is CheckpointState.COMMITTED
    assert kafka.outcome_reads == [(only.transactional_id, tuple(tuple(x) for x in offsets))]
    assert_invariants(c, settled=True)



@pytest.mark.parametrize("order", ["by partition", "reversed"])
def test_commit_stores_the_records_with_the_decision_in_one_transaction(
    coordinator: Coordinator, kafka: RecordingControlPlane, monkeypatch: pytest.MonkeyPatch, order: str
):
    """By partition, the commit's transaction is the decision's statement alone (with its locks);
    in another order the general path judges the request first, then ends with that statement."""
    c = coordinator
    gen = start(c)
    first = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2).pre_leases
    results = [PartitionResult(x.partition, x.id, record(x.id)) for x in first]
    if order == "reversed":
        results.reverse()
    original = driver_sql.run_together

    def commit_dying_after_the_decision(committed: bool) -> Any:
        """The coordinator dies once the decision statement ran (records, states, event), with or
        without the COMMIT it carries; what the record then holds."""
        def decide_then_die(conn: Any, statements: Any, *, commit: bool = False) -> Any:
            if statements[0][0] is not hot_path._DECIDE_FIRST_TRIES:
                return original(conn, statements, commit=commit)
            assert commit
            original(conn, statements, commit=committed)
            raise RuntimeError("the coordinator died")

        with monkeypatch.context() as patched, pytest.raises(RuntimeError):
            patched.setattr(driver_sql, "run_together", decide_then_die)
            c.commit(NAME, 0, 1, gen, results, ACTOR)
        return c.snapshot()

    # before its COMMIT, nothing of it stuck: no record without its decision, no decision without its records
    snap = commit_dying_after_the_decision(committed=False)
    assert {x.state for x in snap.leases} == {LeaseState.LEASED}
    assert {x.producer_id for x in snap.leases} == {None}
    assert snap.checkpoints[0].state is CheckpointState.OPEN and kafka.commits == []
    # with it, the decision and its records are durable together
    snap = commit_dying_after_the_decision(committed=True)
    assert {x.state for x in snap.leases} == {LeaseState.COMMITTING}
    assert {x.producer_id for x in snap.leases} == {2000 + x.id for x in first}
    assert snap.checkpoints[0].state is CheckpointState.COMMITTING and kafka.commits == []

    done = c.commit(NAME, 0, 1, gen, results, ACTOR)  # a retry finishes the decided commit
    assert done.checkpoint.state is CheckpointState.COMMITTED
    stored = {x.id: x for x in c.snapshot().leases}
    # the hot path's statements answer ids; the leases it builds from what it wrote are the rows
    assert done.winners == [stored[x.id] for x in first] and len(first) == 2
    assert first == [stored[x.id].with_changes(state=LeaseState.LEASED, resolved_at=None, producer_id=None,
                                                      producer_epoch=None, records=None, bytes=None, write_ms=None,
                                                      first_offsets=None, precommitted_at=None) for x in first]
    for x in first:
        r = record(x.id)
        assert (stored[x.id].producer_id, stored[x.id].producer_epoch, stored[x.id].records, stored[x.id].bytes,
                stored[x.id].write_ms, json.loads(stored[x.id].first_offsets)) == (r.producer_id, 0, 5, 50, 7, r.first_offsets)
    # Kafka was resumed with the stored producer ids and epochs
    assert sorted((t.transactional_id, t.producer_id, t.producer_epoch) for _, t in kafka.commits) == sorted(
        (x.transactional_id, 2000 + x.id, 0) for x in first)
    # a retried commit answers the same; one with another record for a winner is refused
    assert c.commit(NAME, 0, 1, gen, results, ACTOR).checkpoint == done.checkpoint
    assert len(kafka.commits) == 2
    assert_invariants(c, settled=True)


def test_a_winner_without_a_record_or_pre_commit_is_refused(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    first = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1).pre_leases
    before = c.snapshot()
    with pytest.raises(e.Conflict) as refused:
        c.commit(NAME, 0, 1, gen, [PartitionResult(0, first[0].id)], ACTOR)
    assert refused.value.reason == e.WINNER_NOT_PRECOMMITTED
    assert c.snapshot() == before and kafka.commits == []


def test_the_commit_gate_applies_to_records_that_come_with_the_commit(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    gen = start(c, transaction_timeout_ms=60_000, commit_margin_ms=6_000)
    first = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1).pre_leases
    clock.advance(ms=54_001)  # 5,999 ms left: inside the margin
    with pytest.raises(e.Conflict) as refused:
        c.commit(NAME, 0, 1, gen, [PartitionResult(0, first[0].id, record(first[0].id))], ACTOR)
    assert refused.value.reason == e.DEADLINE_TOO_CLOSE
    assert kafka.commits == [] and kafka.aborts == [(NAME, first[0].transactional_id)]
    assert_invariants(c, settled=True)


# --- issue 15 item 1: no quick reuse ----------------------------------------------------------------


def test_a_zombie_first_try_can_no_longer_fence_the_next_batch(engine: Engine):
    """The finding: a first try stalls before init_transactions; its retry wins; the commit aborts
    and frees the stalled try's id; the next batch leases that id and writes; the stalled try's
    InitProducerId then reaches the broker and fences the next batch (LOST). With the quarantine
    the next batch writes on another id, and the zombie's late init fences nobody."""
    clock = ManualClock()
    model = KafkaModel(clock)
    c = Coordinator(engine, ModelControlPlane(model), clock=clock, limits=Limits(kafka_parallelism=1))
    try:
        gen = start(c, transaction_timeout_ms=60_000, commit_margin_ms=6_000)

        def write(lease: Any, value: str) -> PrecommitRecord:
            pid, epoch = model.init_producer_id(lease.transactional_id, 60_000)
            model.produce(lease.transactional_id, pid, epoch, "out", 0, value)
            return PrecommitRecord(pid, epoch, 1, len(value))

        (stalled,) = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1).pre_leases  # first try: stalls
        retry = c.begin_partition(NAME, 0, 1, gen, 0, 5)
        c.commit(NAME, 0, 1, gen, [PartitionResult(0, retry.id, write(retry, "batch0"))], ACTOR)
        assert pool(c)[stalled.transactional_id][0] is TransactionalIdState.FREE  # aborted, in quarantine

        clock.advance(seconds=1)
        (nxt,) = c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=1).pre_leases
        assert nxt.transactional_id != stalled.transactional_id
        rec = write(nxt, "batch1")
        model.init_producer_id(stalled.transactional_id, 60_000)  # the zombie's InitProducerId lands now
        done = c.commit(NAME, 1, 1, gen, [PartitionResult(0, nxt.id, rec)], ACTOR)
        assert done.checkpoint.state is CheckpointState.COMMITTED
        assert model.read_committed("out") == ["batch0", "batch1"]

        # after the quarantine the id is reused, least recently released first
        clock.advance(ms=QUARANTINE_MS)
        (later,) = c.begin_checkpoint(NAME, 2, gen, ACTOR, partitions=1).pre_leases
        assert later.transactional_id == stalled.transactional_id
        assert_invariants(c)
    finally:
        c.close()


def test_the_pool_takes_the_least_recently_released_id(coordinator: Coordinator, kafka: RecordingControlPlane,
                                                       clock: ManualClock):
    c = coordinator
    gen = start(c)
    first = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3).pre_leases
    # committed in the order 2, 0, 1 (one batch each time would do the same)
    c.commit(NAME, 0, 1, gen, [PartitionResult(x.partition, x.id, record(x.id)) for x in first], ACTOR)
    with c.engine.begin() as conn:  # make the release times differ as successive batches would
        for i, x in enumerate((first[2], first[0], first[1])):
            conn.execute(text("UPDATE transactional_ids SET released_at = :t WHERE transactional_id = :tid"),
                         {"t": clock.now() - timedelta(seconds=10 - i), "tid": x.transactional_id})
    (nxt,) = c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=1).pre_leases
    assert nxt.transactional_id == first[2].transactional_id


def test_a_quarantine_shorter_than_a_try_can_reach_the_broker_is_refused(engine: Engine):
    with pytest.raises(e.Invalid) as refused:
        Coordinator(engine, None, limits=Limits(lease_max_init_age_ms=30_000, producer_init_timeout_ms=60_000,
                                                producer_request_timeout_ms=60_000,
                                                transactional_id_quarantine_ms=150_000))
    assert refused.value.reason == "transactional_id_quarantine_too_short"


# --- issue 15 item 2: one clock ---------------------------------------------------------------------


class _SkewedDatetime(datetime):
    skew = timedelta(0)

    @classmethod
    def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + cls.skew


def test_a_replica_clock_10_s_off_changes_no_decision(engine: Engine, kafka: RecordingControlPlane,
                                                      monkeypatch: pytest.MonkeyPatch):
    """Two replicas with the default clock: one grants the leases while the host clock runs 10 s
    ahead, the other decides while it runs 10 s behind. The lease times and the gate are the
    database's, so the commit past the margin is refused all the same (the landed code took the
    granting replica's clock for the deadline and the deciding one's for now, and decided it)."""
    monkeypatch.setattr(clock_module, "datetime", _SkewedDatetime)
    granting, deciding = Coordinator(engine, kafka), Coordinator(engine, kafka)
    try:
        _SkewedDatetime.skew = timedelta(seconds=10)
        gen = start(granting, transaction_timeout_ms=2_500, commit_margin_ms=1_000)
        with engine.connect() as conn:
            db_before = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        (lease,) = granting.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1).pre_leases
        with engine.connect() as conn:
            db_after = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        assert db_before <= lease.leased_at <= db_after  # the database's time, not the host's
        assert lease.deadline_at == lease.leased_at + timedelta(milliseconds=2_500)

        _SkewedDatetime.skew = timedelta(seconds=-10)
        while datetime.now(UTC) < lease.leased_at + timedelta(milliseconds=1_600):
            time.sleep(0.05)
        with pytest.raises(e.Conflict) as refused:
            deciding.commit(NAME, 0, 1, gen, [PartitionResult(0, lease.id, record(lease.id))], ACTOR)
        assert refused.value.reason == e.DEADLINE_TOO_CLOSE and kafka.commits == []
        assert_invariants(deciding, settled=True)
    finally:
        granting.close()
        deciding.close()


# --- issue 15 item 3: a batch is its offsets ------------------------------------------------------


def _mismatches() -> float:
    return REGISTRY.get_sample_value("coordinator_offsets_mismatch_total", {"sink": NAME}) or 0.0


def test_a_begin_over_other_offsets_is_refused_loudly(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    (x,) = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1, offsets_digest="sha256:aaaa").pre_leases
    c.commit(NAME, 0, 1, gen, [PartitionResult(0, x.id, record(x.id))], ACTOR)
    # the query restarts from a checkpoint location restored from an older backup: same query id,
    # batch 0 re-planned over other offsets. Skipping it as committed would lose the new data.
    gen2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    seen = _mismatches()
    with pytest.raises(e.Conflict) as refused:
        c.begin_checkpoint(NAME, 0, gen2, ACTOR, partitions=1, offsets_digest="sha256:bbbb")
    assert refused.value.reason == e.OFFSETS_MISMATCH and refused.value.status == 409
    assert refused.value.detail["bound_digest"] == "sha256:aaaa"
    assert "lineage/reset" in refused.value.message
    assert _mismatches() == seen + 1
    kinds = [ev["kind"] for ev in c.list_events(NAME)]
    assert "offsets_mismatch" in kinds
    # the same offsets (a plain replay) skip as before; a begin without a digest is not checked
    assert c.begin_checkpoint(NAME, 0, gen2, ACTOR, offsets_digest="sha256:aaaa").action is BeginAction.SKIP
    assert c.begin_checkpoint(NAME, 0, gen2, ACTOR).action is BeginAction.SKIP
    # an open batch is bound too: its replay over other offsets is refused, not continued
    c.begin_checkpoint(NAME, 1, gen2, ACTOR, partitions=1, offsets_digest="sha256:cccc")
    with pytest.raises(e.Conflict) as open_refused:
        c.begin_checkpoint(NAME, 1, gen2, ACTOR, partitions=1, offsets_digest="sha256:dddd")
    assert open_refused.value.reason == e.OFFSETS_MISMATCH
    assert_invariants(c)


# --- calls per batch, over real HTTP ----------------------------------------------------------------


def test_a_batch_costs_two_calls_and_a_retried_task_one_more(database_url: str, tmp_path: Path):
    with ServiceProcess(database_url, "admin-secret", tmp_path) as svc:
        admin = httpx.Client(base_url=svc.url, headers={"Authorization": "Bearer admin-secret"})
        registered = admin.post("/v1/sinks", json={"name": NAME, "transactional_id_prefix": PREFIX,
                                                   "bootstrap_servers": "kafka:9092", "topics": ["out"]})
        assert registered.status_code == 201, registered.text
        token = registered.json()["writer_token"]
        calls: list[str] = []
        client = CoordinatorClient(svc.url, token, NAME)
        client._http.event_hooks["request"] = [lambda r: calls.append(r.url.path)]
        gen = client.start_generation("q1", "r1")["generation"]

        def batch(batch_id: int, retried: bool, topic_partitions: int = 1) -> dict[str, Any]:
            calls.clear()
            begun = client.begin(batch_id, gen, partitions=2, offsets=f"sha256:{batch_id:04x}")
            pre = {x["partition"]: x for x in begun["pre_leases"]}
            assert sorted(pre) == [0, 1] and begun["max_lease_init_age_ms"] == 30_000
            winners = {p: pre[p]["lease_id"] for p in pre}
            if retried:  # partition 1's first try failed: its retry leases its own id
                winners[1] = client.lease(batch_id, begun["attempt"], gen, 1, 900 + batch_id)["lease_id"]
            records = {p: {"producer_id": 10 + p, "producer_epoch": 0, "records": 3, "bytes": 30, "write_ms": 1,
                           "first_offsets": [["out", k, 100 + p] for k in range(topic_partitions)]} for p in winners}
            return client.commit(batch_id, begun["attempt"], gen, winners, 5, records=records)

        answer = batch(0, retried=False)
        assert answer["state"] == "COMMITTED" and len(answer["committed"]) == 2
        assert len(calls) == 2, calls  # begin + commit, whatever the partitions did
        assert batch(1, retried=True)["state"] == "COMMITTED"
        assert len(calls) == 3, calls
        calls.clear()
        detail = client.checkpoint(1, page_size=2)  # the service answers two leases at a time
        assert len(calls) == 2 and sorted(x["partition"] for x in detail["leases"]) == [0, 1, 1], calls
        assert sorted(x["lease_id"] for x in detail["leases"]) == [x["lease_id"] for x in detail["leases"]]
        assert detail["lease_counts"] == {"ABORTED": 1, "COMMITTED": 2} and detail["next_after_lease_id"] is None
        # an older writer reporting every topic-partition its transaction wrote: the coordinator keeps
        # the first FIRST_OFFSETS_KEPT as sent, for a first try on the attempt's row and a retry's lease
        assert batch(2, retried=True, topic_partitions=10)["state"] == "COMMITTED"
        engine = make_engine(database_url)
        with engine.connect() as conn:
            stored = conn.execute(text(
                "SELECT l.partition, l.task_attempt_id, l.first_offsets FROM leases AS l "
                "JOIN checkpoints AS c ON c.id = l.checkpoint_id WHERE c.batch_id = 2 AND l.state = 'COMMITTED' "
                "ORDER BY l.partition")).all()
        engine.dispose()
        assert [(p, t == FIRST_TRY_TASK_ATTEMPT, json.loads(f)) for p, t, f in stored] == [
            (p, p == 0, [["out", k, 100 + p] for k in range(FIRST_OFFSETS_KEPT)]) for p in (0, 1)]
        client.close()
        admin.close()
