"""A task try's lease through `Coordinator` (real Postgres, record-only Kafka, manual clock): the
first try of a partition claims its pre-lease, every other try gets an id of its own, a retried
request answers the same lease; the id pool (round-robin, held until resolved, quarantined after
an abort, grown up to max_pool_size, then exhausted); scale-down between attempts; and the lease
calls of fenced, stale or ended attempts change nothing (I5)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from coordinator.kafka.control_plane import ControlPlaneError, RecordingControlPlane
from coordinator.protocol import errors as e
from coordinator.protocol.model import Lease
from coordinator.protocol.states import LeaseState
from coordinator.service import Coordinator
from coordinator.service.clock import ManualClock
from fixtures.protocol_calls import (  # noqa: F401 - fixtures
    ACTOR,
    NAME,
    PREFIX,
    QUARANTINE_MS,
    assert_invariants,
    claimed,
    counts,
    empty,
    event_kinds,
    held,
    ids_of,
    invariants_hold_at_the_end,
    lease_state,
    offline,
    pools,
    quarantined,
    refused,
    start,
    won,
)


def test_the_first_try_claims_the_pre_lease_and_a_retried_request_answers_the_same(
        coordinator: Coordinator, clock: ManualClock):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    (pre,) = [x for x in c.checkpoint_detail(NAME, 0).leases if x.partition == 1]
    clock.advance(ms=700)
    grant = c.lease(NAME, 0, 1, gen, 1, 42)
    x = grant.lease
    assert (x.id, x.ordinal, x.transactional_id, x.taken_at) == (pre.id, pre.ordinal, pre.transactional_id, pre.taken_at)
    assert x.state is LeaseState.LEASED and x.task_attempt_id == 42
    assert x.leased_at == clock.now() and x.deadline_at == clock.now() + (pre.deadline_at - pre.leased_at)
    assert grant.age_ms == 0
    rows, pool_rows = counts(c.engine), pools(c.engine)
    clock.advance(ms=250)
    again = c.lease(NAME, 0, 1, gen, 1, 42)
    assert again.lease == x and again.age_ms == 250  # the same lease, its age by the clock
    assert counts(c.engine) == rows and pools(c.engine) == pool_rows


def test_any_other_try_gets_an_id_of_its_own(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    tries = [c.lease(NAME, 0, 1, gen, 0, t).lease for t in (100, 101, 102)]  # failed, retry, speculative
    assert len({x.id for x in tries}) == 3 and len(set(ids_of(tries))) == 3
    assert [x.ordinal for x in tries] == [0, 2, 3]  # the first claims ordinal 0; the pool grows for the others
    assert c.lease(NAME, 0, 1, gen, 0, 101).lease == tries[1]  # the retry's own retry
    (other,) = [c.lease(NAME, 0, 1, gen, 1, 103).lease]
    result = c.commit(NAME, 0, 1, gen, [won(tries[2]), won(other)], ACTOR)  # the speculative copy won
    assert sorted(w.id for w in result.winners) == sorted([tries[2].id, other.id])
    assert sorted(t.transactional_id for _, t in kafka.commits) == ids_of([tries[2], other])
    # the tries that did not win may have written: aborted on Kafka, their ids quarantined
    assert sorted(t for _, t in kafka.aborts) == ids_of(tries[:2])
    assert {lease_state(c, x.id) for x in tries[:2]} == {LeaseState.ABORTED}
    assert quarantined(c) == {tries[0].ordinal, tries[1].ordinal}
    assert held(c) == []
    assert_invariants(c, settled=True)


def test_task_attempt_ids_are_whatever_spark_gives(coordinator: Coordinator):
    """Spark's task attempt ids are unique per SparkContext; none is special (issue 50 §2)."""
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    big = c.lease(NAME, 0, 1, gen, 0, 2**62).lease
    zero = c.lease(NAME, 0, 1, gen, 0, 0).lease
    assert big.task_attempt_id == 2**62 and zero.task_attempt_id == 0 and big.id != zero.id


def test_tries_asking_at_once_never_share_an_id(coordinator: Coordinator):
    """Eight tries of one partition ask at once (a stage retry and speculative copies): exactly one
    claims the pre-lease, each of the others gets an id of its own; eight copies of one try's
    request (client retries) all get its one lease, with a pre-lease to claim or without."""
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=2)
    (pre,) = [x for x in c.checkpoint_detail(NAME, 0).leases if x.partition == 0]
    barrier = threading.Barrier(8)

    def ask(batch: int, partition: int, task: int) -> Lease:
        barrier.wait(10)
        return c.lease(NAME, batch, 1, gen, partition, task).lease

    with ThreadPoolExecutor(8) as pool:
        tries = list(pool.map(lambda t: ask(0, 0, t), range(1_000, 1_008)))
        copies = list(pool.map(lambda _: ask(0, 1, 77), range(8)))
        c.begin_checkpoint(NAME, 1, gen, ACTOR)  # no pre-leases: each try's id is granted
        granted = list(pool.map(lambda _: ask(1, 0, 88), range(8)))
    assert len({x.transactional_id for x in tries}) == 8 and len({x.id for x in tries}) == 8
    assert sum(x.id == pre.id for x in tries) == 1
    assert len({x.id for x in copies}) == 1 and copies[0].task_attempt_id == 77
    assert len([x for x in c.checkpoint_detail(NAME, 0).leases if x.partition == 1]) == 1  # the pre-lease, claimed
    assert len({x.id for x in granted}) == 1 and len(c.checkpoint_detail(NAME, 1).leases) == 1
    assert_invariants(c)


# --- the id pool -----------------------------------------------------------------------------


def test_the_pool_hands_out_ids_round_robin_least_recently_leased_first(coordinator: Coordinator,
                                                                      kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=4)
    first = claimed(c, 0, 1, gen, 4)
    c.commit(NAME, 0, 1, gen, [won(x) for x in first], ACTOR)  # committed winners: free at once
    c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=2)
    second = claimed(c, 1, 1, gen, 2)
    assert [x.ordinal for x in second] == [0, 1]  # the cursor wrapped after 3
    c.commit(NAME, 1, 1, gen, [won(x) for x in second], ACTOR)
    c.begin_checkpoint(NAME, 2, gen, ACTOR, partitions=3)
    third = claimed(c, 2, 1, gen, 3)
    assert [x.ordinal for x in third] == [2, 3, 0]  # 2 and 3 were leased least recently
    assert pools(c.engine)[0][1:] == (4, 1)


def test_the_pool_holds_ids_until_their_aborts_succeed(coordinator: Coordinator, kafka: RecordingControlPlane,
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
    assert held(c) == ids_of(three)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    fresh = c.begin_partition(NAME, 0, 3, gen, 0, 20)
    assert fresh.transactional_id == f"{PREFIX}-3"  # the pool grows rather than reuse a held id
    assert sorted(c.run_pending_aborts(NAME).aborted) == ids_of(three)
    # aborted, so no longer held, but quarantined: a try of them may still reach the broker
    assert held(c) == [fresh.transactional_id] and quarantined(c, clock.now()) == {0, 1, 2}
    assert c.begin_partition(NAME, 0, 3, gen, 1, 21).transactional_id == f"{PREFIX}-4"
    clock.advance(ms=QUARANTINE_MS)
    more = [c.begin_partition(NAME, 0, 3, gen, p, 30 + p) for p in (1, 2)]
    assert [x.transactional_id for x in more] == [f"{PREFIX}-0", f"{PREFIX}-1"]
    assert pools(c.engine)[0][1] == 5
    assert_invariants(c, settled=False)


def test_pool_exhaustion(coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock):
    c = coordinator
    gen = start(c, max_pool_size=2)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    c.begin_partition(NAME, 0, 1, gen, 0, 1)
    c.begin_partition(NAME, 0, 1, gen, 1, 2)
    err = refused(c, kafka, lambda: c.begin_partition(NAME, 0, 1, gen, 2, 3), e.POOL_EXHAUSTED, e.Unavailable)
    assert err.status == 503 and err.detail == {"asked": 1, "free": 0, "max_pool_size": 2}
    # a retry of a granted lease still works
    assert c.begin_partition(NAME, 0, 1, gen, 1, 2).transactional_id == f"{PREFIX}-1"
    c.abort_attempt(NAME, 0, 1, gen, "too small", ACTOR)
    c.begin_checkpoint(NAME, 0, gen, ACTOR)
    # both ids are in quarantine (freed from undecided tries): the pool is exhausted until it ends
    refused(c, kafka, lambda: c.begin_partition(NAME, 0, 2, gen, 2, 3), e.POOL_EXHAUSTED, e.Unavailable)
    clock.advance(ms=QUARANTINE_MS)
    assert c.begin_partition(NAME, 0, 2, gen, 2, 3).transactional_id == f"{PREFIX}-0"
    assert pools(c.engine)[0][1] == 2


# --- scale-down ------------------------------------------------------------------------------


def test_scale_down_between_attempts_with_aborts_pending(
    coordinator: Coordinator, offline: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    g1 = start(offline)
    offline.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=8)
    first = claimed(offline, 0, 1, g1, 8)
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

    result = coordinator.commit(NAME, 0, 2, g2, [won(x) for x in second], ACTOR)
    assert result.attempt.partitions == 3
    assert sorted(t.transactional_id for _, t in kafka.commits) == ids_of(second)
    assert (NAME, reused.transactional_id) in kafka.aborts[8:]
    assert_invariants(coordinator, settled=True)


def test_scale_down_with_control_plane_aborts_every_possibly_open_id(
    coordinator: Coordinator, kafka: RecordingControlPlane, clock: ManualClock
):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=8)
    first = claimed(c, 0, 1, g1, 8)
    g2, fenced = c.start_generation(NAME, "q1", "r2", ACTOR)
    assert sorted(fenced.aborted) == ids_of(first) and fenced.pending == []
    assert sorted(t for _, t in kafka.aborts) == ids_of(first)
    begun = c.begin_checkpoint(NAME, 0, g2, ACTOR)
    assert sorted(begun.older_aborted) == ids_of(first) and begun.older_abort_pending == []
    clock.advance(ms=QUARANTINE_MS)
    c.begin_checkpoint(NAME, 0, g2, ACTOR)
    second = [c.begin_partition(NAME, 0, 2, g2, p, 100 + p) for p in range(3)]
    assert ids_of(second) == [f"{PREFIX}-{i}" for i in range(3)]  # resolved ids are reused after quarantine
    c.commit(NAME, 0, 2, g2, [won(x) for x in second], ACTOR)
    assert len(kafka.aborts) == 8
    assert_invariants(c, settled=True)


def test_fewer_partitions_in_a_later_batch(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=8)
    wide = claimed(c, 0, 1, gen, 8)
    c.commit(NAME, 0, 1, gen, [won(x) for x in wide], ACTOR)
    c.begin_checkpoint(NAME, 1, gen, ACTOR, partitions=3)
    narrow = claimed(c, 1, 1, gen, 3, first_task=10)
    assert ids_of(narrow) == [f"{PREFIX}-{i}" for i in range(3)]
    refused(c, kafka, lambda: c.commit(NAME, 1, 1, gen, [won(narrow[0]), won(narrow[1]), empty(3)], ACTOR),
            "partitions_incomplete", e.Invalid)
    result = c.commit(NAME, 1, 1, gen, [won(x) for x in narrow], ACTOR)
    assert result.attempt.partitions == 3 and len(result.winners) == 3
    assert len(kafka.commits) == 11 and kafka.aborts == []
    assert pools(c.engine)[0][1] == 8 and held(c) == [] and quarantined(c) == set()
    assert_invariants(c, settled=True)


# --- stale lease calls change nothing (I5) --------------------------------------------------


def test_lease_calls_of_fenced_superseded_aborted_or_decided_attempts(coordinator: Coordinator,
                                                                     kafka: RecordingControlPlane):
    c = coordinator
    g1 = start(c)
    c.begin_checkpoint(NAME, 0, g1, ACTOR, partitions=2)
    (old,) = claimed(c, 0, 1, g1, 1)
    g2, _ = c.start_generation(NAME, "q1", "r2", ACTOR)
    c.begin_checkpoint(NAME, 0, g2, ACTOR, partitions=2)
    new = claimed(c, 0, 2, g2, 2, first_task=200)

    # the zombie driver's executors (generation 1), and a generation nobody started
    refused(c, kafka, lambda: c.lease(NAME, 0, 1, g1, 1, 9), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.lease(NAME, 0, 2, g1, 1, 9), e.STALE_GENERATION)
    refused(c, kafka, lambda: c.lease(NAME, 0, 2, g2 + 1, 0, 9), e.UNKNOWN_GENERATION)
    # the current generation naming the superseded attempt
    refused(c, kafka, lambda: c.lease(NAME, 0, 1, g2, 1, 9), e.STALE_ATTEMPT)
    # a retried lease request of the fenced try: its lease is no longer live
    refused(c, kafka, lambda: c.lease(NAME, 0, 1, g2, 0, old.task_attempt_id), e.STALE_LEASE)
    refused(c, kafka, lambda: c.lease(NAME, 0, 2, g2, 256, 9), "partition_out_of_range", e.Invalid)

    c.commit(NAME, 0, 2, g2, [won(x) for x in new], ACTOR)
    # decided: a new try gets no lease, and a winner's try asking again is told its lease is stale
    refused(c, kafka, lambda: c.lease(NAME, 0, 2, g2, 0, 77), e.COMMIT_DECIDED)
    refused(c, kafka, lambda: c.lease(NAME, 0, 2, g2, 0, new[0].task_attempt_id), e.STALE_LEASE)


def test_lease_calls_naming_no_such_batch_or_attempt_are_404(coordinator: Coordinator,
                                                            kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=1)
    refused(c, kafka, lambda: c.lease(NAME, 0, 9, gen, 0, 9), "unknown_attempt", e.NotFound)
    refused(c, kafka, lambda: c.lease(NAME, 5, 1, gen, 0, 9), "unknown_checkpoint", e.NotFound)


def test_lease_calls_of_an_aborted_attempt(coordinator: Coordinator, kafka: RecordingControlPlane):
    c = coordinator
    gen = start(c)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3)
    (x,) = claimed(c, 0, 1, gen, 1)
    c.abort_attempt(NAME, 0, 1, gen, "driver_gave_up", ACTOR)
    # the aborted attempt is still the current one: its unclaimed pre-leases are not claimable
    refused(c, kafka, lambda: c.lease(NAME, 0, 1, gen, 1, 3), e.ATTEMPT_ABORTED)
    refused(c, kafka, lambda: c.lease(NAME, 0, 1, gen, 0, x.task_attempt_id), e.STALE_LEASE)
    c.begin_checkpoint(NAME, 0, gen, ACTOR, partitions=3)
    refused(c, kafka, lambda: c.lease(NAME, 0, 1, gen, 2, 3), e.STALE_ATTEMPT)
