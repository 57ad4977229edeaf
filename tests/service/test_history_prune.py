"""Pruning old batch history (`Coordinator.prune_history`, POST /v1/history/prune, `coordinator
prune-history`, the recovery loop's retention): the bulky record of old COMMITTED batches goes,
and nothing the protocol decides changes. Real Postgres per test; Kafka is the record-only control
plane (this is about bookkeeping: pruning never talks to Kafka)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, text

from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.invariants import check_invariants
from coordinator.protocol.model import Lease, PartitionResult, PrecommitRecord
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import CheckpointState
from coordinator.service import Coordinator, SinkSpec
from coordinator.service import recovery
from coordinator.service.clock import ManualClock
from coordinator.service.recovery import RecoveryLoop
from coordinator.store import events as store_events
from coordinator.store.tables import attempts, checkpoints, events, leases

ACTOR = "test"
HOUR = timedelta(hours=1)


def start(c: Coordinator, name: str) -> int:
    c.register_sink(SinkSpec(name, f"{name}-eos", "kafka:9092", ["out"]), ACTOR)
    return c.start_generation(name, "q1", "r1", ACTOR)[0]


def record(x: Lease) -> PrecommitRecord:
    return PrecommitRecord(x.task_attempt_id, 2000 + x.id % 1000, 0, 5, 50, 7, [["out", 0, 40]])  # type: ignore[arg-type]


def batch(c: Coordinator, name: str, batch_id: int, gen: int, *, partitions: int = 2, speculative: bool = False) -> None:
    """One committed batch, each partition's first try claiming its pre-lease; with `speculative`,
    partition 0's first try loses to a copy (its abort is a Kafka call, so the batch has a lease
    to resolve)."""
    c.begin_checkpoint(name, batch_id, gen, ACTOR, partitions=partitions, offsets_digest=f"sha256:{batch_id:04d}")
    first = [c.lease(name, batch_id, 1, gen, p, 10 + p).lease for p in range(partitions)]
    results = [PartitionResult(x.partition, x.id, record(x)) for x in first]
    if speculative:
        copy = c.lease(name, batch_id, 1, gen, 0, 77).lease
        results[0] = PartitionResult(0, copy.id, record(copy))
    assert c.commit(name, batch_id, 1, gen, results, ACTOR).checkpoint.state is CheckpointState.COMMITTED


def old_batches(c: Coordinator, clock: ManualClock, n: int, *, speculative: int | None = None) -> int:
    """Sink "orders" with batches 0..n-1 committed three hours ago; returns its generation."""
    gen = start(c, "orders")
    for b in range(n):
        batch(c, "orders", b, gen, speculative=b == speculative)
    clock.advance(seconds=3 * 3600)
    return gen


def rows(c: Coordinator, table: Any, *where: Any) -> list[Any]:
    with c.engine.connect() as conn:
        return conn.execute(select(table).where(*where)).all()


def assert_invariants(c: Coordinator) -> None:
    assert [str(v) for v in check_invariants(c.snapshot())] == []


def test_old_batches_lose_their_bulky_history_and_every_begin_decides_as_before(
        coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock) -> None:
    c = coordinator
    gen = start(c, "orders")
    for b in range(5):
        batch(c, "orders", b, gen, speculative=b == 1)
    clock.advance(seconds=3 * 3600)
    batch(c, "orders", 5, gen)  # recent: kept
    c.begin_checkpoint("orders", 6, gen, ACTOR, partitions=2)  # open: kept
    old = {r.batch_id: r.id for r in rows(c, checkpoints, checkpoints.c.batch_id < 5)}
    sink_events_before = len(rows(c, events, events.c.checkpoint_id.is_(None)))

    dry = c.prune_history(2 * HOUR, ACTOR, dry_run=True)
    assert (dry.pruned, dry.candidates, dry.by_sink) == (0, 5, {"orders": 5})
    assert len(rows(c, attempts)) == 7  # a dry run deletes nothing

    first = c.prune_history(2 * HOUR, ACTOR, limit=2)
    assert (first.pruned, first.more) == (2, True)
    second = c.prune_history(2 * HOUR, ACTOR, limit=2)
    third = c.prune_history(2 * HOUR, ACTOR, limit=2)
    assert (second.pruned, second.more, third.pruned, third.more) == (2, True, 1, False)
    assert c.prune_history(2 * HOUR, ACTOR).pruned == 0  # nothing left: pruning again is harmless

    pruned_ids = list(old.values())
    assert rows(c, attempts, attempts.c.checkpoint_id.in_(pruned_ids)) == []
    assert rows(c, leases, leases.c.checkpoint_id.in_(pruned_ids)) == []
    assert rows(c, events, events.c.checkpoint_id.in_(pruned_ids)) == []
    kept = rows(c, checkpoints, checkpoints.c.batch_id >= 5)
    assert [(r.batch_id, r.history_pruned_at) for r in sorted(kept)] == [(5, None), (6, None)]
    assert len(rows(c, attempts)) == 2  # batches 5 and 6 keep theirs
    marked = rows(c, checkpoints, checkpoints.c.id.in_(pruned_ids))
    assert all(r.state == "COMMITTED" and r.history_pruned_at is not None and r.offsets_digest for r in marked)
    # the sink's own events stay, and each pruning call says what it took
    trail = rows(c, events, events.c.checkpoint_id.is_(None))
    pruned_events = [r.detail for r in trail if r.kind == "history_pruned"]
    assert len(trail) == sink_events_before + 3
    assert [(d["batches"], d["first_batch_id"], d["last_batch_id"]) for d in pruned_events] == [
        (2, 0, 1), (2, 2, 3), (1, 4, 4)]

    # an operator's resume of one answers that it is committed and its history pruned
    with pytest.raises(e.Conflict) as resumed:
        c.resume("orders", 3)
    assert resumed.value.reason == e.HISTORY_PRUNED
    detail = c.checkpoint_detail("orders", 3)
    assert (detail.checkpoint.state, detail.attempts, detail.leases) == (CheckpointState.COMMITTED, [], [])
    # the open batch goes on
    assert c.begin_checkpoint("orders", 6, gen, ACTOR, partitions=2).action is BeginAction.CONTINUE
    tries = [c.lease("orders", 6, 1, gen, p, 60 + p).lease for p in range(2)]
    c.commit("orders", 6, 1, gen, [PartitionResult(x.partition, x.id, record(x)) for x in tries], ACTOR)
    # a re-plan of a pruned batch over other offsets is refused; its replay is skipped as committed
    with pytest.raises(e.Conflict) as refused:
        c.begin_checkpoint("orders", 1, gen, ACTOR, partitions=2, offsets_digest="sha256:other")
    assert refused.value.reason == e.OFFSETS_MISMATCH
    replay = c.begin_checkpoint("orders", 1, gen, ACTOR, partitions=2, offsets_digest="sha256:0001")
    assert replay.action is BeginAction.SKIP and replay.checkpoint.history_pruned_at is not None
    assert replay.pre_leased == 0
    assert_invariants(c)


def test_a_batch_with_an_abort_still_pending_and_each_querys_newest_batch_are_kept(
        coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = coordinator
    gen = start(c, "orders")
    batch(c, "orders", 0, gen)

    def unreachable(*_: Any) -> None:
        raise ControlPlaneError("broker unreachable", retriable=False)

    with monkeypatch.context() as m:  # batch 1's losing first try cannot be aborted yet
        m.setattr(kafka, "abort", unreachable)
        batch(c, "orders", 1, gen, speculative=True)
    batch(c, "orders", 2, gen)
    other = start(c, "payments")
    batch(c, "payments", 0, other)
    clock.advance(seconds=3 * 3600)

    outcome = c.prune_history(2 * HOUR, ACTOR)
    assert (outcome.pruned, outcome.by_sink) == (1, {"orders": 1})  # orders' batch 0 alone
    with c.engine.connect() as conn:
        state = dict(conn.execute(text(
            "SELECT s.name || ':' || c.batch_id, c.history_pruned_at IS NOT NULL FROM checkpoints c "
            "JOIN sinks s ON s.id = c.sink_id")).all())
    assert state == {"orders:0": True, "orders:1": False, "orders:2": False, "payments:0": False}
    # once the abort went through (the recovery loop's pending aborts), batch 1 goes too
    assert c.run_pending_aborts("orders").aborted
    assert c.prune_history(2 * HOUR, ACTOR, sink="orders").pruned == 1
    assert_invariants(c)


def test_history_younger_than_an_hour_is_never_pruned(coordinator: Coordinator) -> None:
    with pytest.raises(e.Invalid) as refused:
        coordinator.prune_history(timedelta(minutes=59), ACTOR)
    assert "younger than 1:00:00" in refused.value.message
    with pytest.raises(e.Invalid):
        coordinator.prune_history(HOUR, ACTOR, limit=0)


def test_the_recovery_loop_prunes_with_a_retention_set_a_chunk_per_iteration_while_there_is_a_backlog(
        coordinator: Coordinator, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    c = coordinator
    gen = old_batches(c, clock, 4)
    monkeypatch.setattr(recovery, "PRUNE_CHUNK", 2)
    ticks = [0.0]
    kept = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000, holder="replica-a", monotonic=lambda: ticks[0])
    assert kept.run_once().pruned == 0  # no retention: nothing is pruned
    loop = RecoveryLoop(c, interval_ms=50, leader_ttl_ms=10_000, holder="replica-a", monotonic=lambda: ticks[0],
                        history_retention=2 * HOUR)
    assert [loop.run_once().pruned for _ in range(3)] == [2, 1, 0]  # the backlog, then nothing due
    batch(c, "orders", 4, gen)  # batch 3 is no longer the newest, but it is not due again yet
    clock.advance(seconds=3 * 3600)
    assert loop.run_once().pruned == 0
    ticks[0] += recovery.PRUNE_EVERY_S
    assert loop.run_once().pruned == 1
    assert c.prune_history(2 * HOUR, ACTOR, dry_run=True).candidates == 0
    kinds = [ev["kind"] for ev in c.list_events("orders")]
    assert kinds.count("history_pruned") == 3
    assert_invariants(c)


def test_a_replay_that_meets_a_prune_in_flight_waits_for_it_and_a_new_batch_does_not(
        coordinator: Coordinator, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    c = coordinator
    gen = old_batches(c, clock, 3)
    inside, release = threading.Event(), threading.Event()
    real_add_event = store_events.add

    def add_event_then_hold(conn: Any, sink_id: int, kind: str, *args: Any, **kw: Any) -> None:
        real_add_event(conn, sink_id, kind, *args, **kw)
        if kind == "history_pruned":  # the chunk is deleted and its rows locked, not yet committed
            inside.set()
            release.wait(30)

    monkeypatch.setattr(store_events, "add", add_event_then_hold)
    with ThreadPoolExecutor(2) as pool:
        pruning = pool.submit(c.prune_history, 2 * HOUR, ACTOR)
        assert inside.wait(30)
        replay = pool.submit(c.begin_checkpoint, "orders", 0, gen, ACTOR, partitions=2, offsets_digest="sha256:0000")
        time.sleep(0.5)
        assert not replay.done()  # it waits for the batch's row, locked by the prune
        fresh = c.begin_checkpoint("orders", 3, gen, ACTOR, partitions=2)  # the live query goes on meanwhile
        assert fresh.action is BeginAction.NEW_ATTEMPT
        release.set()
        assert pruning.result(30).pruned == 2
        assert replay.result(30).action is BeginAction.SKIP  # it saw the batch pruned, still committed
    assert_invariants(c)


def test_a_batch_an_id_still_names_is_kept(coordinator: Coordinator, clock: ManualClock) -> None:
    """The safety net behind the unresolved-lease checks: while one of a batch's leases still holds
    its id (resolved_at NULL: its transaction may be open), the batch is kept."""
    c = coordinator
    old_batches(c, clock, 3, speculative=1)  # batch 1's speculative copy won; its first try lost
    first_try = next(x.id for x in c.checkpoint_detail("orders", 0).leases if x.partition == 1)
    lost_try = next(x.id for x in c.checkpoint_detail("orders", 1).leases if x.state.value == "ABORTED")
    with c.engine.begin() as conn:
        conn.execute(text("UPDATE leases SET state = 'ABORTING', resolved_at = NULL WHERE id IN (:a, :b)"),
                     {"a": first_try, "b": lost_try})
    assert c.prune_history(2 * HOUR, ACTOR, dry_run=True).candidates == 0
    with c.engine.begin() as conn:
        conn.execute(text("UPDATE leases SET state = 'ABORTED', resolved_at = now() WHERE id = :a"), {"a": first_try})
    assert c.prune_history(2 * HOUR, ACTOR).by_sink == {"orders": 1}  # batch 0; batch 1 stays
    assert c.checkpoint_detail("orders", 1).leases != []
