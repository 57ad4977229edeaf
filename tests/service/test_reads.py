"""The coordinator's reads that the dashboard and the sink pages use, through `Coordinator` (real
Postgres, record-only Kafka, manual clock): the bulk overview answers as the per-sink reads do,
and a sink's possibly open transactions are counted without loading a wide batch's pre-leases."""

from __future__ import annotations

from coordinator.kafka.control_plane import RecordingControlPlane
from coordinator.protocol import recovery_rules
from coordinator.protocol.states import CheckpointState, LeaseState
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import (  # noqa: F401 - fixtures
    ACTOR,
    NAME,
    claimed,
    invariants_hold_at_the_end,
    spec,
    start,
    won,
)


def test_sink_overviews_answer_as_the_per_sink_reads(coordinator: Coordinator, kafka: RecordingControlPlane):
    """The dashboard overview's bulk read gives each sink what the per-sink reads give: the newest
    checkpoints of its current lineage only (an earlier lineage's commits are not its last commit),
    at most `recent` of them, and its possibly open transactions."""
    c = coordinator

    def commit_batches(name: str, gen: int, batches: range) -> None:
        for b in batches:
            c.begin_checkpoint(name, b, gen, ACTOR, partitions=1)
            (x,) = claimed(c, b, 1, gen, 1, name=name)
            c.commit(name, b, 1, gen, [won(x)], ACTOR)

    g1 = start(c, query="q1")
    commit_batches(NAME, g1, range(3))
    c.reset_lineage(NAME, "operator", "new checkpoint location")
    g2, _ = c.start_generation(NAME, "q2", "r2", ACTOR)
    c.begin_checkpoint(NAME, 0, g2, ACTOR, partitions=1)
    claimed(c, 0, 1, g2, 1)  # the new lineage's first batch, open, its try holding its lease
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
    assert orders.last_committed is None and [x.state for x in orders.near_timeout_candidates] == [LeaseState.LEASED]
    # a wide batch just begun: its pre-leases hold ids but no transaction (no try holds them yet)
    c.begin_checkpoint("busy", 8, other, ACTOR, partitions=40)
    busy, _, orders = c.sink_overviews(recent=5)
    assert busy.open_transactions == 0 and busy.near_timeout_candidates == []
    c.lease("busy", 8, 1, other, 5, 505)  # a try claims one: its transaction may be open
    busy, _, orders = c.sink_overviews(recent=5)
    assert busy.open_transactions == 1 and busy.near_timeout_candidates[0].partition == 5
    assert orders.open_transactions == 1 and len(orders.near_timeout_candidates) == 1


def test_open_transactions_in_brief_count_all_and_load_the_oldest_and_the_deciding(
        coordinator: Coordinator, clock: ManualClock) -> None:
    """A sink page's read: the count of possibly open transactions, the `oldest` of them by lease
    time, and every one the near-timeout rule reads; a wide batch's pre-leases hold ids but no
    transaction (no try holds them), so none of them is counted or loaded."""
    c = coordinator
    gen = start(c)
    begun = c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=40)
    clock.advance(ms=1_000)
    first = c.lease(NAME, 0, begun.attempt.number, gen, 3, 76).lease  # claims partition 3's pre-lease
    retry = c.lease(NAME, 0, begun.attempt.number, gen, 3, 77).lease  # its retry: an id of its own
    brief = c.open_transactions_in_brief(NAME, 5)
    every = c.possibly_open_transactions(NAME)
    assert brief.count == len(every) == 2 and every == [first, retry]
    assert brief.oldest == [first, retry]
    assert brief.near_timeout_candidates == [first, retry]
    assert c.open_transactions_in_brief(NAME, 1).oldest == [first]


def test_pool_usage(coordinator: Coordinator) -> None:
    c = coordinator
    gen = start(c, max_pool_size=64)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3)
    claimed(c, 0, 1, gen, 1)
    c.lease(NAME, 0, 1, gen, 0, 999)
    usage = c.pool_usage(NAME)
    assert (usage.size, usage.leased, usage.max_size) == (4, 4, 64)
